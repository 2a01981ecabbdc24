"""How busy each side of a step was: the CPU time of the device's thread and of everything else.

No schedule can make a step shorter than the work of its busiest side. On a machine of CPUs only, the
emulated device's compute is this thread (torch's kernels on its cores) and the host's share (the CPU's
Adam, the copies standing in for DMA, the accumulation of gradients) runs on the engine's other threads, so

    device busy   CPU time of this thread
    host busy     CPU time of the rest of the process (threads that have exited included: the C Adam's)

and the bound of a schedule is max(device busy / device cores, host busy / host cores) when each side has cores
of its own (`cores` split), or (device + host) / cores when both share all of them. A step at the bound hides
every stage of the other side completely. The numbers come from the kernel's accounting (getrusage, the
thread's clock), so they count work, not waiting: a thread blocked on an event adds nothing.

What a step takes beyond its device's busy time, the device's thread spent off its core:

    waited        blocked in Event.wait (accelerator/streams.py): for a copy, a staging slot, the host's Adam
    the rest      runnable but not running: waiting for the GIL (the hooks and queues of every thread are
                  Python, and only one thread runs Python at a time), or for its core
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass

from ...accelerator.streams import seconds_blocked


def cpu_seconds() -> tuple[float, float, float]:
    """(this process's CPU seconds so far, this thread's, this thread's seconds blocked on events); call it from
    the device's thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, time.thread_time(), seconds_blocked()


@dataclass(frozen=True)
class Busy:
    """Seconds of CPU used over some steps: `device` by the device's thread, `host` by the others; and
    `waited`, the seconds the device's thread was blocked on events meanwhile."""

    device: float
    host: float
    waited: float = 0.0

    @classmethod
    def since(cls, start: tuple[float, float, float]) -> Busy:
        """The CPU time used since `start` (from cpu_seconds(), read on this same thread)."""
        process, thread, blocked = cpu_seconds()
        device = thread - start[1]
        return cls(device, max(process - start[0] - device, 0.0), blocked - start[2])

    def __add__(self, other: Busy) -> Busy:
        return Busy(self.device + other.device, self.host + other.host, self.waited + other.waited)

    def bound(self, device_cores: int, host_cores: int | None) -> float:
        """The shortest time this work could take: each side on its own cores (`host_cores`), or with
        `host_cores` None both sharing `device_cores`."""
        if host_cores is None:
            return max(self.device, (self.device + self.host) / device_cores)
        return max(self.device / device_cores, self.host / max(host_cores, 1))
