"""Gradient buckets: gradients leave the device in large, contiguous pieces while backward is still running.

Backward produces gradients layer by layer, from the output back to the input. Waiting for all of them before
reducing would hold a full gradient on the device (what ZeRO-2 removes) and leave the network idle during
backward. Reducing each parameter's gradient alone would send thousands of tiny messages, each paying the
collective's fixed latency. A bucket sits between the two:

  1. a post-accumulate-grad hook fires when a parameter's gradient is complete; it is added into its unit's
     staging buffer and `param.grad` is dropped (the gradient now lives only in the bucket);
  2. when every parameter of a unit has arrived, the unit joins the current bucket, in a fixed order: the
     collectives of all ranks pair up by their order, so every rank must reduce the same unit at the same
     turn, whatever order its hooks fired in (a branch one rank's data never took fires no hook at all);
  3. once the bucket holds `reduce_bucket_size` elements it is reduce-scattered (asynchronously with
     `overlap_comm`), so rank r receives the averaged shard r of each unit in it;
  4. when a reduction completes, `deliver(index, shard)` hands the shard on: into the device gradient shard
     (ZeRO-2) or across PCIe into the host's fp32 gradient buffer (ZeRO-Offload, see offload.py).

The fixed order is the units' own, backwards (backward usually finishes the last module first). A unit that
finishes early waits for the units before it in that order; at the end of backward every unit not reduced yet
is reduced, its missing gradients as zeros, as torch DDP does for unused parameters: each rank adds zero for a
parameter it did not use, and the average is the one a single process would compute on the whole batch.

The device holds the buckets in flight, about `reduce_bucket_size` elements, plus the units that finished out
of order (in a sequential model, at most about one layer's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..accelerator import Accelerator
from .comm import Comm
from .partition import Unit

# reduce(comm, full_grad, shard_out, async_op=...) -> handle or None: principles.zero.reduce_scatter_unit
ReduceScatter = Callable[..., object]


def _finished(handle) -> bool:
    return handle is None or handle.is_completed()


class GradientBuckets:
    """Collects gradients per unit as backward produces them and reduce-scatters them bucket by bucket."""

    def __init__(
        self,
        units: list[Unit],
        accel: Accelerator,
        comm: Comm,
        dtype: torch.dtype,
        *,
        bucket_numel: int,
        overlap: bool,
        reduce: ReduceScatter,
        deliver: Callable[[int, torch.Tensor], None],
        on_unit_complete: Callable[[int], None] | None = None,
    ):
        self.units, self.accel, self.comm, self.dtype = units, accel, comm, dtype
        self.bucket_numel, self.overlap = bucket_numel, overlap
        self.reduce, self.deliver, self.on_unit_complete = reduce, deliver, on_unit_complete
        self._unit_of = {id(p): (index, i) for index, u in enumerate(units) for i, p in enumerate(u.params)}
        self._staging: dict[int, torch.Tensor] = {}  # unit index -> its full gradient being collected
        self._missing: dict[int, set[int]] = {}  # unit index -> its parameters whose gradient has not arrived
        # The turn of each unit's reduction, the same on all ranks.
        self._order = list(reversed(range(len(units))))
        self._turn = 0  # units self._order[:self._turn] have joined a bucket in this backward
        self._arrived = False  # any gradient in this backward
        self._bucket: list[int] = []  # complete units waiting for the bucket to fill
        self._inflight: list = []  # (index, staging, shard, handle) of reductions started

    def register_hooks(self) -> None:
        for unit in self.units:
            for param in unit.params:
                param.register_post_accumulate_grad_hook(self.add)

    def add(self, param: torch.nn.Parameter) -> None:
        """The post-accumulate-grad hook: move `param.grad` into its unit's staging buffer."""
        index, i = self._unit_of[id(param)]
        unit = self.units[index]
        self._arrived = True
        staging = self._staging_of(index)
        staging[unit.offsets[i] : unit.offsets[i] + unit.numels[i]].copy_(param.grad.reshape(-1))
        self._missing[index].discard(i)
        param.grad = None  # the gradient lives only in the bucket now
        if not self._missing[index]:
            if self.on_unit_complete is not None:
                self.on_unit_complete(index)
            self._take_turns(until_incomplete=True)

    def _staging_of(self, index: int) -> torch.Tensor:
        staging = self._staging.get(index)
        if staging is None:
            # Every parameter's gradient is written once (its hook fires once per backward, after autograd has
            # summed all its uses), so only the padding needs zeros; parameters that never arrive are zeroed
            # when the unit is flushed.
            unit = self.units[index]
            staging = self._staging[index] = self.accel.empty(
                unit.padded_numel, self.dtype, category="buckets"
            )
            staging[unit.numel :].zero_()
            self._missing[index] = set(range(len(unit.params)))
        return staging

    def _take_turns(self, *, until_incomplete: bool) -> None:
        """Move the units whose turn has come into the bucket, in the fixed order, flushing it when full; with
        `until_incomplete`, stop at the first unit still missing a gradient (the end of backward does not)."""
        while self._turn < len(self._order):
            index = self._order[self._turn]
            if until_incomplete and self._missing.get(index, True):  # not started, or not complete yet
                return
            self._staging_of(index)  # a unit no gradient reached on this rank: zeros
            self._bucket.append(index)
            self._turn += 1
            if sum(self.units[j].padded_numel for j in self._bucket) >= self.bucket_numel:
                self.flush()

    def flush(self) -> None:
        """Start the reduce-scatter of every unit in the current bucket."""
        for index in self._bucket:
            staging = self._staging.pop(index)
            unit = self.units[index]
            for i in self._missing.pop(index):  # unused in this backward: a zero gradient
                staging[unit.offsets[i] : unit.offsets[i] + unit.numels[i]].zero_()
            if self.comm.world_size == 1:  # nothing to average or scatter: the bucket is this rank's shard
                shard, handle = staging, None
            else:
                shard = self.accel.empty(self.units[index].shard_numel, self.dtype, category="buckets")
                handle = self.reduce(self.comm, staging, shard, async_op=self.overlap)
            self._inflight.append((index, staging, shard, handle))
        self._bucket = []
        if not self.overlap:
            self.drain()
        else:
            self._deliver_finished()

    def _deliver_finished(self) -> None:
        """Deliver, in order, the reductions that have already completed: their shards can move on now rather
        than at the end of backward (module 5's pipeline starts copying them down at once)."""
        while self._inflight and _finished(self._inflight[0][3]):
            index, _staging, shard, handle = self._inflight.pop(0)
            if handle is not None:
                handle.wait()
            self.deliver(index, shard)

    def drain(self) -> None:
        """Wait for the reductions in flight and deliver their shards, in the order they were started."""
        for index, _staging, shard, handle in self._inflight:
            if handle is not None:
                handle.wait()
            self.deliver(index, shard)
        self._inflight = []  # staging and shards die here: the bucket memory goes back to the device

    def finish(self) -> None:
        """End of backward: reduce what is left (the last bucket, units with unused parameters) and wait.

        A backward that produced no gradient at all was skipped (a non-finite loss on any rank skips it on
        every rank, divergence.py): nothing is reduced, so that no zeros reach an Adam that runs as they land."""
        if self._arrived:
            self._take_turns(until_incomplete=False)
        self.flush()
        self.drain()
        self._missing.clear()
        self._turn, self._arrived = 0, False
