"""Where module 5's pipeline puts the host's gradients: the fp32 partition, or, for DPU, areas of their own.

The fp32 partition (OffloadedStates.grad_shards) is where gradients are added up: it is "undefined" as
allocated (never touched, so it takes no memory until used; a direct run never uses it), "zero", or "dirty"
once something was added into it, and it is cleared on the host queue, behind the step's work.

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

import torch

from ..basics.norm import squared_norm
from ..implementation.transfers import host_buffer


class HostGradients:
    """The fp32 partition's state and DPU's two areas, for OffloadPipeline (which provides `states`, `accel`,
    `grads`, `updated`, `deliver`, the `copy` and `host` streams, `squared_norms`, `_pending`, `wait`,
    `_keep_until` and `_upload_early`)."""

    kept: list[list[torch.Tensor]] | None = None  # area -> one region per host unit
    keeping = False  # this step's gradients go to the areas (decided at each backward)
    area = 0  # the area this step's backward writes
    landed: frozenset[int] = frozenset()  # the units whose gradient this step's backward kept

    def define_gradients(self) -> None:
        """Before the step reads the fp32 partition: a unit no gradient reached this step reads zeros there, not
        memory that a direct run (which never writes the partition) left as it was allocated."""
        if self.grads == "undefined" and len(self.updated) < self.states.host_units:
            self._clear_grads_if("undefined")
            self.wait()

    def zero_grad(self) -> None:
        """Clear the host's fp32 gradients on the host queue, behind this step's work, while forward runs."""
        self._clear_grads_if("dirty")

    def _clear_grads_if(self, state: str) -> None:
        if self.grads == state:
            self._pending.append(self.host.submit(self.states.flat_grad.zero_))
            self.grads = "zero"

    def receive(self, index: int, shard: torch.Tensor) -> None:
        """Backward hands over unit `index`'s reduced shard: into this step's area under DPU, else `deliver`."""
        if self.keeping:  # DPU: this step's gradient stays where it lands until the delayed Adam
            self._deliver_kept(index, shard)
        else:
            self.deliver(index, shard)

    # -- DPU's kept gradients --------------------------------------------------------------------------------
    def keep_gradients(self) -> None:
        """Allocate the two areas (call once, when the delayed update runs with one micro-batch)."""
        states = self.states
        sizes = [unit.shard_numel for unit in states.units[: states.host_units]]
        self.kept = []
        for _ in range(2):
            flat = host_buffer(self.accel, sum(sizes), states.dtype, pin=states.pin_optimizer)
            self.kept.append(list(flat.split(sizes)))

    def _deliver_kept(self, index: int, shard: torch.Tensor) -> None:
        """Unit `index`'s gradient down the link into its region of this step's area; its norm on the host."""
        region = self.kept[self.area][index]
        self.landed = self.landed | {index}
        # The norm is summed here, never inside the delayed Adam: DPU reports it before that Adam runs
        # (updating.wants_norm_in_adam is false under DPU).
        if self.copy.runs_on_host:  # emulated: the copy's own thread sums the region while it is in cache
            down = self.copy.submit(self._copy_and_norm, index, region, shard)
            self._pending.append(down)
        else:  # CUDA: the host reads the region once the copy has landed
            down = self.copy.submit(self.states.transfers.to_host, region, shard, blocking=False)
            self.host.wait_event(down)
            self._pending.append(self.host.submit(self._kept_norm, index, region))
        if self._early_after is not None:
            self._upload_early(index)
        self._keep_until(shard, down)

    def _kept_norm(self, index: int, region: torch.Tensor) -> None:
        self.squared_norms[index] = squared_norm(region)

    def _copy_and_norm(self, index: int, region: torch.Tensor, shard: torch.Tensor) -> None:
        # One task instead of two: one hand-over less between threads, and the sum reads what the copy just wrote.
        self.states.transfers.to_host(region, shard, blocking=False)
        self._kept_norm(index, region)

    def kept_gradients(self) -> list[torch.Tensor]:
        """The gradients this step's backward kept, one per host unit, for the delayed Adam to read. A unit no
        gradient reached this step (unused) still holds one from two steps ago: it reads zeros instead, as in
        the serial step. Nothing else reads the area now: its last Adam has finished."""
        regions = self.kept[self.area]
        for index in set(range(len(regions))) - self.landed:
            regions[index].zero_()
        return regions

    def next_area(self) -> None:
        """At the end of a step: the next backward writes the other area."""
        if self.keeping:
            self.area = 1 - self.area
        self.landed = frozenset()
