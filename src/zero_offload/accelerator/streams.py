"""Streams and events: queues of device work that run in order, and the marks that say when work is done.

A CUDA stream is a queue on the GPU; the emulated device's stream is one worker thread that runs its queue in
order. Both take work with `submit(fn)`, which returns an `Event`, and both can be told to start later work only
after an event from elsewhere (`wait_event`). The engine orders its copies and the CPU's Adam with nothing else.

Overlap bugs are races, and a race that depends on which thread is faster hides on a fast machine. So the emulated
stream can be held (`hold()`: it starts nothing until released) and asked to go quiet (`wait_quiet()`: return once
it has run everything it can). A test holds one queue, lets the other run as far as its waits allow, and so sees
the interleaving a GPU may produce, every time.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

_running_on = threading.local()  # .stream: the emulated stream whose worker is this thread, if any
_blocked = threading.local()  # .seconds: how long this thread has waited in Event.wait for work not yet done


def seconds_blocked() -> float:
    """How long the calling thread has been blocked in Event.wait so far (work that was done already costs
    nothing): what a schedule makes the device's thread wait for the copies and the host."""
    return getattr(_blocked, "seconds", 0.0)


class Event:
    """Completion of work submitted to a stream: `wait()` blocks the host until it is done."""

    def __init__(self, future: Future | None = None, cuda_event: torch.cuda.Event | None = None):
        self._future, self._cuda_event = future, cuda_event

    def wait(self) -> None:
        if self.done():
            self._wait()  # nothing to wait for, but an exception from the stream's worker still surfaces
            return
        start = time.perf_counter()
        try:
            self._wait()
        finally:
            _blocked.seconds = seconds_blocked() + time.perf_counter() - start

    def _wait(self) -> None:
        if self._cuda_event is not None:
            self._cuda_event.synchronize()
        elif self._future is not None:
            self._future.result()  # re-raises an exception from the stream's worker

    def enqueue_wait(self, stream: torch.cuda.Stream) -> None:
        """CUDA: later work on `stream` waits for this event on the device; a host thread's event is waited for."""
        if self._cuda_event is not None:
            stream.wait_event(self._cuda_event)
        else:
            self.wait()

    def done(self) -> bool:
        if self._cuda_event is not None:
            return self._cuda_event.query()
        return self._future is None or self._future.done()


def on_worker_stream() -> bool:
    """Whether this thread is an emulated stream's worker (work here is already ordered on that stream)."""
    return getattr(_running_on, "stream", None) is not None


def _set_up_worker(cores: list[int] | None, nice: int) -> None:
    """Run by the worker thread before its first task."""
    if cores:
        os.sched_setaffinity(0, cores)
    if nice and hasattr(os, "setpriority"):  # 0: this thread itself (Linux threads each have their own)
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + nice)


class WorkerStream:
    """The emulated device's stream: one worker thread that runs its queue in order.

    Torch kernels and the C Adam release the GIL, so work on one stream really overlaps work on another.
    """

    waits_without_blocking = True  # wait_event() returns at once: the worker thread does the waiting
    runs_on_host = True  # a task's work is done when its function returns: a copy has landed by then

    def __init__(self, name: str, cores: list[int] | None = None, *, nice: int = 0):
        # Pinned to `cores` if given, and `nice` steps less urgent than the thread that makes it; threads it
        # starts (the C Adam's) inherit both.
        self.name = name
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=_set_up_worker, initargs=(cores, nice)
        )
        self._waits: list[Event] = []
        # What the worker is doing, for hold() and wait_quiet(); every change is announced on the condition.
        self._state = threading.Condition()
        self.submitted = 0  # work items ever submitted
        self._unfinished = 0
        self._stuck = False  # the worker waits: for an event not yet done, or for a hold to end
        self._holds = 0

    def wait_event(self, event: Event) -> None:
        """Work submitted after this call starts only once `event` has completed."""
        self._waits.append(event)

    def submit(self, fn, *args, **kwargs) -> Event:
        waits, self._waits = self._waits, []
        with self._state:
            self.submitted += 1
            self._unfinished += 1

        def run():
            try:
                self._wait_for(waits)
                _running_on.stream = self
                return fn(*args, **kwargs)
            finally:
                _running_on.stream = None
                with self._state:
                    self._unfinished -= 1
                    self._state.notify_all()

        return Event(future=self._pool.submit(run))

    def _wait_for(self, waits: list[Event]) -> None:
        with self._state:
            while self._holds:
                self._set_stuck(True)
                self._state.wait()
            self._set_stuck(False)
        for event in waits:
            if not event.done():
                with self._state:
                    self._set_stuck(True)
                try:
                    event.wait()
                finally:
                    with self._state:
                        self._set_stuck(False)

    def _set_stuck(self, stuck: bool) -> None:
        self._stuck = stuck
        self._state.notify_all()

    # -- test hooks: force an interleaving instead of hoping for it ------------------------------------------
    def hold(self) -> _Hold:
        """Start no new work until the returned hold is released (work already running finishes)."""
        with self._state:
            self._holds += 1
        return _Hold(self)

    def release_hold(self) -> None:
        """One hold fewer (what _Hold.release calls); with none left, the worker runs its queue again."""
        with self._state:
            self._holds -= 1
            self._state.notify_all()

    def wait_quiet(self, *, submitted: int = 0, timeout: float = 60.0) -> None:
        """Return once at least `submitted` items were ever submitted and the worker can run nothing more now:
        its queue is empty, or it waits for an event that has not happened, or it is held. A test calls this on
        one queue while another is held, so that the first has run exactly as far as its waits allow."""

        def quiet() -> bool:
            return self.submitted >= submitted and (self._unfinished == 0 or self._stuck)

        with self._state:
            if not self._state.wait_for(quiet, timeout=timeout):
                raise TimeoutError(
                    f"stream {self.name!r} did not go quiet within {timeout:.0f} s "
                    f"({self.submitted} submitted, {self._unfinished} unfinished)"
                )

    def synchronize(self) -> None:
        self.submit(lambda: None).wait()

    def close(self) -> None:
        """Run what is queued, then stop the worker thread; the stream takes no more work."""
        self._pool.shutdown(wait=True)


class _Hold:
    """A hold on a worker stream; `release()` (or leaving the `with` block) lets it run again."""

    def __init__(self, stream: WorkerStream):
        self.stream, self.released = stream, False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.stream.release_hold()

    def __enter__(self) -> _Hold:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class CudaStream:
    """A CUDA stream: `submit` enqueues the kernels of `fn` on it and records an event after them."""

    # Waiting for a CUDA event is enqueued on the stream; waiting for a host thread's work blocks the caller.
    waits_without_blocking = False
    runs_on_host = False  # a task only enqueues kernels: what they write is there once its event is done

    def __init__(self, device: torch.device):
        self._stream = torch.cuda.Stream(device=device)

    @property
    def torch_stream(self) -> torch.cuda.Stream:
        return self._stream

    def wait_event(self, event: Event) -> None:
        event.enqueue_wait(self._stream)

    def submit(self, fn, *args, **kwargs) -> Event:
        # Same contract as the emulated stream: the work sees everything the caller enqueued before it.
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            fn(*args, **kwargs)
            # Blocking: a host that waits for it sleeps, leaving its core to the CPU Adam.
            cuda_event = torch.cuda.Event(blocking=True)
            cuda_event.record(self._stream)
        return Event(cuda_event=cuda_event)

    def synchronize(self) -> None:
        self._stream.synchronize()

    def close(self) -> None:
        """Wait for what is queued; a CUDA stream has no thread of its own to stop."""
        self._stream.synchronize()
