"""ZeRO stages 1, 2 and 3: the model states of data-parallel training, each partitioned over the ranks.

Per unit (the parameters of one module, see partition.py) and rank r of N:

  stage 1  optimizer states (fp32 master, m, v) hold shard r only. Gradients accumulate in a full buffer;
           at the step they are reduce-scattered, so rank r receives the averaged shard r it updates.
  stage 2  gradients too: as backward produces a unit's gradients they are copied into a bucket, and every
           `reduce_bucket_size` elements the bucket is reduce-scattered (asynchronously with `overlap_comm`).
           Each rank keeps only its gradient shard.
  stage 3  weights too: each rank stores weight shard r; a unit is all-gathered just before its module runs
           (forward, and again before its backward) and released right after.

After the update, stage 1/2 all-gather the new weight shards so that every rank holds the full weights again;
stage 3 keeps only its shard until the next gather. (Module 1's MixedPrecisionStates is stage 0.)

ShardedStates is put together from parts it is given or builds: where its buffers live (a placement:
device_buffers.DeviceBuffers here, module 3's host_buffers.HostBuffers when offloaded), stage 3's gather,
prefetch and release of units (stage3_gather.UnitGathering, `states.gathering`), and the gradient buckets
(buckets.py). The gradient norm every stage reports is computed in basics/norm.py (`squared_norm` is imported
here from there).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable

import torch

from ..accelerator import Accelerator
from ..basics.norm import global_norm, squared_norm
from ..basics.precision import LOW_PRECISION, has_overflow, unscaled_fp32
from .buckets import GradientBuckets
from .comm import Comm
from .device_buffers import DeviceBuffers, split_flat
from .partition import Unit, build_units
from .stage3_gather import UnitGathering

# ZeRO-3 gathers the embedding's weights in a backward pre-hook; that its input (token ids) needs no gradient
# is expected, and torch's warning about it would only confuse.
warnings.filterwarnings(
    "ignore", message="Full backward hook is firing when gradients are computed with respect"
)


def fill_shard(params: list[torch.Tensor], unit: Unit, shard: torch.Tensor) -> None:
    """Copy the pieces of `params` that fall in this rank's shard of `unit` into `shard` (padding: zero)."""
    shard.zero_()
    for piece in unit.layout.slices:
        source = params[piece.param].reshape(-1)[piece.param_start : piece.param_start + piece.numel]
        shard[piece.shard_start : piece.shard_start + piece.numel].copy_(source)


def reduce_scatter_unit(
    comm: Comm, full_grad: torch.Tensor, shard_out: torch.Tensor, *, async_op: bool = False
):
    """Average a unit's full gradient over the ranks; this rank receives its own shard of the average."""
    # BEGIN LAB 2.2: reduce-scatter a unit's gradient into the shard this rank owns
    # Every rank holds the whole (padded) gradient of the unit, `full_grad`; rank r must end up with the
    # AVERAGE over ranks of chunk r in `shard_out`. Divide by the world size first (the sum of N fp16
    # gradients can overflow where their average does not), then comm.reduce_scatter(...), passing async_op
    # through and returning what it returns (a handle to wait on, or None).
    full_grad.div_(comm.world_size)
    return comm.reduce_scatter(shard_out, full_grad, async_op=async_op)
    # END LAB 2.2


def all_gather_unit(comm: Comm, full_param: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False):
    """Every rank's weight shard of a unit, concatenated in rank order into the unit's full buffer.

    At stages 1 and 2 `shard` is a view of `full_param` at this rank's own slot: an in-place all-gather,
    which gloo and NCCL both allow (the rank's own slot is simply left as it is).
    """
    return comm.all_gather(full_param, shard, async_op=async_op)


class ShardedStates:
    """Model states partitioned as ZeRO stage 1, 2 or 3 prescribes; the engine drives it step by step.

    What differs between the tiers comes in as arguments: `partition_gradients` (None: from stage 2 on, as
    ZeRO does; module 3 partitions them at every stage) and `place_buffers`, which is given the units and
    returns where their buffers live (None: all on the device, device_buffers.DeviceBuffers), and `group_of`,
    the parameter group of each parameter (None: one group)."""

    transfers = None  # nothing crosses PCIe while every state lives on the device (module 3's do)

    def __init__(
        self,
        model: torch.nn.Module,
        accel: Accelerator,
        precision: str,
        stage: int,
        comm: Comm,
        zero,
        *,
        partition_gradients: bool | None = None,
        place_buffers: Callable[[list[Unit]], object] | None = None,
        group_of: dict[int, int] | None = None,
    ):
        if stage not in (1, 2, 3):
            raise ValueError(f"ShardedStates handles stages 1-3, got {stage}")
        self.accel, self.comm, self.stage, self.precision = accel, comm, stage, precision
        self.dtype = LOW_PRECISION[precision]
        # `group_of`: with parameter groups (engine/param_groups.py), each unit holds one group's parameters.
        self.units = build_units(model, comm.world_size, comm.rank, group_of)
        if not self.units:
            raise ValueError("the model has no trainable parameters")
        self.master_groups = [unit.group for unit in self.units]  # the group of each master piece
        self.params = [p for unit in self.units for p in unit.params]
        self.numel = sum(unit.numel for unit in self.units)
        full_numel = sum(unit.padded_numel for unit in self.units)
        shard_numel = sum(unit.shard_numel for unit in self.units)
        # Elements added to make shards equal; the memory report shows them, never hides them.
        self.padding = {
            "full": full_numel - self.numel,
            "shard": shard_numel - math.ceil(self.numel / comm.world_size),
        }
        # Stage 1 keeps full gradients and reduces them at the step; from stage 2 on they leave in buckets.
        self.partition_gradients = stage >= 2 if partition_gradients is None else partition_gradients
        initial = [p.detach() for p in self.params]  # the model's fp32 values, read before we rebind them
        if place_buffers is None:
            self.buffers = DeviceBuffers(
                self.units, accel, self.dtype, stage=stage, partition_gradients=self.partition_gradients
            )
        else:
            self.buffers = place_buffers(self.units)
        self._take_views(self.buffers)
        self._initialise(initial)
        self._unit_of = {
            id(p): (index, i) for index, unit in enumerate(self.units) for i, p in enumerate(unit.params)
        }
        self.grad_shard_transient = None
        self.gathering = None  # stage 3 only: the other stages always hold the full weights
        if stage == 3:
            self.gathering = UnitGathering(
                self.units,
                accel,
                comm,
                self.full_params,
                prefetch_numel=zero.stage3_prefetch_bucket_size,
                start_gather=self._start_gather,
                adopt=self.adopt_full_weights,
                after_gather=self._gather_landed,
            )
        self.buckets = None
        if self.partition_gradients:
            self.buckets = GradientBuckets(
                self.units,
                accel,
                comm,
                self.dtype,
                bucket_numel=zero.reduce_bucket_size,
                overlap=zero.overlap_comm,
                reduce=reduce_scatter_unit,
                deliver=self._deliver_gradient,
                on_unit_complete=self.gathering.release if self.gathering is not None else None,
            )
            self.buckets.register_hooks()
        if self.gathering is not None:
            self.gathering.install_hooks(model, zero.leaf_module, self._unit_of)

    # -- layout ----------------------------------------------------------------------------------------------
    def _take_views(self, buffers) -> None:
        """The tensors the step works on, flat and unit by unit, wherever the placement put them."""
        self.flat_param, self.full_params, self.param_shards = (
            buffers.flat_param,
            buffers.full_params,
            buffers.param_shards,
        )
        self.flat_grad, self.full_grads, self.grad_shards = (
            buffers.flat_grad,
            buffers.full_grads,
            buffers.grad_shards,
        )
        self.master, self.master_params = buffers.master, buffers.master_params
        self.exp_avg, self.exp_avg_sq = buffers.exp_avg, buffers.exp_avg_sq
        self.exp_avgs, self.exp_avg_sqs = buffers.exp_avgs, buffers.exp_avg_sqs
        self.exp_avg_scales, self.exp_avg_sq_scales = buffers.exp_avg_scales, buffers.exp_avg_sq_scales

    def _split(self, flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return split_flat(flat, sizes)

    @torch.no_grad()
    def _initialise(self, initial: list[torch.Tensor]) -> None:
        start = 0
        for index, unit in enumerate(self.units):
            values = initial[start : start + len(unit.params)]
            start += len(unit.params)
            fill_shard(values, unit, self.master_params[index])  # from fp32: no double rounding
            if self.master is not None:
                self.param_shards[index].copy_(self.master_params[index])
            if self.stage == 3:
                # Allocated for its shape (the parameters become views into it) and freed below, before the
                # next unit's: setting up never holds more than one unit's full weights on the device.
                self.full_params.append(
                    self.accel.empty(unit.padded_numel, self.dtype, category="parameters")
                )
            full = self.full_params[index]
            if self.stage < 3:
                for value, offset, numel in zip(values, unit.offsets, unit.numels, strict=True):
                    full[offset : offset + numel].copy_(value.reshape(-1))
                full[unit.numel :].zero_()
            for param, offset, numel in zip(unit.params, unit.offsets, unit.numels, strict=True):
                param.data = full[offset : offset + numel].view_as(param)
                if not self.partition_gradients:
                    param.grad = self.full_grads[index][offset : offset + numel].view_as(param)
            if self.stage == 3:
                # The parameters are views into `full` through .data, which shares memory but not autograd's
                # version counter: refilling the memory before backward is not an in-place change of a weight
                # autograd saved.
                unit.gathered, unit.pending = False, None
                self.accel.free_storage(full)

    # -- stage 3: how a unit's buffer is filled (when, and what else is prefetched, is stage3_gather.py's) ----
    def _shard_on_device(self, index: int) -> torch.Tensor:
        """This rank's weight shard of unit `index`, where a collective can read it (module 3 offloads it)."""
        return self.param_shards[index]

    def _start_gather(self, index: int, *, async_op: bool):
        unit = self.units[index]
        shard = self._shard_on_device(index)
        # BEGIN LAB 2.4: bring a stage-3 unit's full weights onto the device
        # The unit's full buffer (self.full_params[index]) was freed after its last use: its shape survives,
        # its memory does not. Allocate the memory again with self.accel.restore_storage(...), then all-gather
        # every rank's `shard` (this rank's weights of the unit, on the device) into it, passing async_op
        # through. Mark the unit gathered and return the collective's handle. (The gathering's release() frees it.)
        self.accel.restore_storage(self.full_params[index], "parameters")
        work = all_gather_unit(self.comm, self.full_params[index], shard, async_op=async_op)
        unit.gathered = True
        return work
        # END LAB 2.4

    def _gather_landed(self, index: int) -> None:
        """Unit `index`'s gather has landed or was given up: nothing to free here (module 3 frees its upload)."""

    @contextlib.contextmanager
    def gathered(self, params=None, *, modifier_rank: int | None = None):
        """Full weights of `params` (default: all) until the block ends; with `modifier_rank`, what that rank
        wrote into them becomes every rank's weights and fp32 masters. Every rank must enter it."""
        if self.gathering is not None:
            with self.gathering.access.gathered(params, modifier_rank=modifier_rank):
                yield
            return
        yield  # stages 1 and 2 always hold the full weights
        if modifier_rank is not None:
            self.adopt_full_weights(range(len(self.units)), modifier_rank)

    @torch.no_grad()
    def adopt_full_weights(self, indices, source_rank: int) -> None:
        """The full weights of units `indices` on `source_rank` become everyone's: weight shards and masters."""
        if not 0 <= source_rank < self.comm.world_size:
            raise ValueError(
                f"modifier_rank={source_rank} is not a rank of this job of {self.comm.world_size}"
            )
        for index in indices:
            full, layout = self.full_params[index], self.units[index].layout
            self.comm.broadcast(full, source_rank)
            shard = full[layout.start : layout.end]
            for target in (self.param_shards[index], self.master_params[index]):
                if target.data_ptr() != shard.data_ptr():
                    target.copy_(shard)

    # -- stage 2/3: gradients leave in buckets as backward produces them (principles/buckets.py) ---------
    def _deliver_gradient(self, index: int, shard: torch.Tensor) -> None:
        self.grad_shards[index].add_(shard)  # accumulates over micro-batches

    # -- what the engine calls, in order -----------------------------------------------------------------------
    def before_forward(self) -> None:
        if self.gathering is not None:
            self.gathering.begin_phase("forward")

    def before_backward(self) -> None:
        if self.gathering is not None:
            self.gathering.begin_phase("backward")
        if not self.partition_gradients:
            for unit, full in zip(self.units, self.full_grads, strict=True):
                for param, offset, numel in zip(unit.params, unit.offsets, unit.numels, strict=True):
                    if param.grad is None:  # model.zero_grad() set it to None
                        param.grad = full[offset : offset + numel].view_as(param)

    def after_backward(self) -> None:
        """Reduce what backward left in buckets: the last bucket, and units with unused parameters."""
        if self.buckets is not None:
            self.buckets.finish()
        if self.gathering is not None:
            self.gathering.begin_phase("forward")

    def reduce_gradients(self) -> None:
        if not self.partition_gradients:
            # The averaged shard exists from here to the end of the step; the full gradients stay, as stage 1
            # keeps them.
            flat = self.accel.empty(sum(u.shard_numel for u in self.units), self.dtype, category="buckets")
            self.grad_shard_transient = flat
            self.grad_shards = self._split(flat, [u.shard_numel for u in self.units])
            for full, shard in zip(self.full_grads, self.grad_shards, strict=True):
                reduce_scatter_unit(self.comm, full, shard)

    def _grad_shard_flat(self) -> torch.Tensor:
        return self.flat_grad if self.partition_gradients else self.grad_shard_transient

    def overflow(self) -> bool:
        return self.comm.any(has_overflow(self._grad_shard_flat()))

    def fp32_gradients(self, inv_scale: float) -> list[torch.Tensor]:
        """This rank's gradient shard in fp32, divided by the loss scale (`inv_scale` = 1 / scale)."""
        flat = unscaled_fp32(self.accel, self._grad_shard_flat(), inv_scale)
        return self._split(flat, [u.shard_numel for u in self.units])

    def grad_norm(self, grads: list[torch.Tensor]) -> float:
        return global_norm((squared_norm(g) for g in grads), self.comm.sum)  # basics/norm.py

    def publish(self, *, rounded: bool = False) -> None:
        """After the fp32 update: the new weights where forward will read them. `rounded` (the host's Adam wrote
        them rounded already, module 4) is asked of every states object; Adam on the device never rounds."""
        # BEGIN LAB 2.3: publish the updated weights
        # For every unit: if there is a separate fp32 master (fp16/bf16 runs: self.master is not None), round
        # self.master_params[index] into this rank's low-precision shard self.param_shards[index]. Then, at
        # stages 1 and 2, every rank must hold the full weights again: all_gather_unit(...) into
        # self.full_params[index]. At stage 3 the shard is all that is kept (it is gathered when next used).
        for index in range(len(self.units)):
            if self.master is not None:
                self.param_shards[index].copy_(self.master_params[index])
            if self.stage < 3:
                all_gather_unit(self.comm, self.full_params[index], self.param_shards[index])
        # END LAB 2.3

    def zero_grad(self) -> None:
        self.flat_grad.zero_()
        if not self.partition_gradients:
            self.grad_shard_transient = None
            self.grad_shards = None

    def each_unit(self, *, write: bool = False):
        """Each unit's index, its master and moments readable (and, with `write`, writable) meanwhile: here they
        always are; module 5's NVMe tier brings each in from its files (checkpoints walk the units this way)."""
        yield from range(len(self.units))

    def record(self, ledger) -> None:
        self.buffers.record(ledger)  # the placement knows which tensor holds which state

    def host_staging_bytes(self) -> int:
        return self.buffers.host_staging_bytes()

    def close(self) -> None:
        """Nothing of its own to stop: the engine's streams and the process group are the engine's."""
