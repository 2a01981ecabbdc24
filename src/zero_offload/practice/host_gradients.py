"""Where module 5's pipeline puts the host's gradients: the fp32 partition, or, for DPU, areas of their own.

OffloadPipeline (pipeline.py) owns one `GradientPartition` and, when the delayed update keeps its gradients, one
`KeptGradients`, each built with the buffers it holds. They queue their work where they are told (the partition
on the host queue it was built with, the kept areas on the streams each call hands them) and return its events:
the pipeline waits for those before the step goes on.

The fp32 partition (OffloadedStates.grad_shards) is where gradients are added up. Its state is one of
`PartitionState`: UNDEFINED as allocated (never touched, so it takes no memory until used; a direct run never
uses it), ZERO, or DIRTY once something was added into it. It is cleared on the host queue, behind the step's
work.

DPU with one micro-batch: each gradient keeps a place of its own until its Adam.

Without this, the gradients of step t+1 are added into the host's fp32 gradient partition while the delayed Adam
of step t is still reading that partition. They can only be queued behind that Adam on the host queue: the
staging slots then run out and backward waits for the CPU, and the host pays two more passes over the gradient
each step (the add into the partition, and clearing it).

With a single micro-batch nothing is added: a unit's gradient arrives once a step. So each unit's gradient
lands straight in a region of its own, and two areas of regions take turns, one step each:

    step t     backward writes area A   the host sums each unit's squared norm as it lands
    step t+1   backward writes area B   meanwhile the delayed Adam of step t reads area A
    step t+2   backward writes area A   Adam(t) finished at step t+1, before Adam(t+1) was launched

The delayed Adam reads the gradient as it came down the link: fp32 as it is, bf16 by module 4's C Adam, which
reads it in its own precision. The fp32 partition is never used.
The areas cost the gradient's size twice on the host (2 x 2 bytes/param in bf16, 2 x 4 in fp32), about what
DPU's snapshot of the fp32 gradient costs without the pipeline. Not with fp16: its loss scale is divided out,
and its overflow is checked, in the fp32 partition.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

from ..accelerator.streams import Event
from ..basics.norm import squared_norm
from ..implementation.transfers import host_buffer


class PartitionState(enum.Enum):
    UNDEFINED = "as allocated: never written, so what it holds is whatever the memory held"
    ZERO = "cleared (or queued to be, on the host queue)"
    DIRTY = "a gradient was added into it since it was last cleared"


class GradientPartition:
    """The host's fp32 gradient partition: `flat`, seen as one shard per unit (`shards`), written only by tasks
    on the `host` queue, so that every write is ordered behind the work already queued there (Adam included)."""

    def __init__(self, flat: torch.Tensor, shards: list[torch.Tensor], host):
        self.flat, self.shards, self.host = flat, shards, host
        self.state = PartitionState.UNDEFINED

    def clear_if(self, state: PartitionState) -> Event | None:
        """Queue the partition's clearing if it is in `state`; the event of that, or None if nothing was queued."""
        if self.state is not state:
            return None
        self.state = PartitionState.ZERO
        return self.host.submit(self.flat.zero_)

    def add(self, index: int, staging: torch.Tensor, inv_scale: float, norms: dict | None) -> Event:
        """Queue `staging` x `inv_scale` added into unit `index`'s shard (call clear_if(UNDEFINED) first). If the
        gradient is then complete, `norms` is given: its squared norm goes there, while the shard is in cache."""
        self.state = PartitionState.DIRTY
        return self.host.submit(self._add, index, staging, inv_scale, norms)

    def _add(self, index: int, staging: torch.Tensor, inv_scale: float, norms: dict | None) -> None:
        grad = self.shards[index]
        grad.add_(staging, alpha=inv_scale)
        if norms is not None:
            norms[index] = squared_norm(grad)


class KeptGradients:
    """DPU's two areas, each one region per host unit (`sizes` elements each, in `dtype`), taking turns a step each.

    `to_host(dst, src, blocking=...)` copies down the link (Transfers.to_host: it counts the bytes, and times
    the copy on the timeline)."""

    def __init__(self, accel, sizes: list[int], dtype: torch.dtype, *, pin: bool, to_host: Callable):
        self.areas = [list(host_buffer(accel, sum(sizes), dtype, pin=pin).split(sizes)) for _ in range(2)]
        self.to_host = to_host
        # The area this step's backward writes.
        self.area = 0
        # The units whose gradient this step's backward kept.
        self.landed: frozenset[int] = frozenset()

    def receive(self, index: int, shard: torch.Tensor, *, down, host, norms: dict) -> tuple[Event, Event]:
        """Unit `index`'s gradient down the `down` stream into its region of this step's area, and its squared
        norm into `norms`; the events of the copy (its last read of `shard`) and of the norm."""
        region = self.areas[self.area][index]
        self.landed = self.landed | {index}
        # The norm is summed here, never inside the delayed Adam: DPU reports it before that Adam runs
        # (optimizer_step.wants_norm_in_adam is false under DPU).
        if down.runs_on_host:
            # Emulated: one task instead of two, one hand-over less between threads, and the copy's own thread
            # sums the region while it is still in cache.
            copied = down.submit(self._copy_and_norm, index, region, shard, norms)
            return copied, copied
        # CUDA: the host reads the region once the copy has landed.
        copied = down.submit(self.to_host, region, shard, blocking=False)
        host.wait_event(copied)
        return copied, host.submit(self._norm, index, region, norms)

    def _copy_and_norm(self, index: int, region: torch.Tensor, shard: torch.Tensor, norms: dict) -> None:
        self.to_host(region, shard, blocking=False)
        self._norm(index, region, norms)

    @staticmethod
    def _norm(index: int, region: torch.Tensor, norms: dict) -> None:
        norms[index] = squared_norm(region)

    def gradients(self) -> list[torch.Tensor]:
        """The gradients this step's backward kept, one per host unit, for the delayed Adam to read. A unit no
        gradient reached this step (unused) still holds one from two steps ago: it reads zeros instead, as in
        the serial step. Nothing else reads the area now: its last Adam has finished."""
        regions = self.areas[self.area]
        for index in set(range(len(regions))) - self.landed:
            regions[index].zero_()
        return regions

    def next_area(self, *, kept: bool) -> None:
        """At the end of a step: the next backward writes the other area, if this step's gradients were `kept`."""
        if kept:
            self.area = 1 - self.area
        self.landed = frozenset()

    def buffers(self) -> list[torch.Tensor]:
        return [region for area in self.areas for region in area]
