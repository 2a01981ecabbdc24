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

Stage 3's gather, prefetch and release machinery is in stage3_gather.py (ShardedStates inherits it); the
gradient norm every stage reports is computed in basics/norm.py (`squared_norm` is imported here from there).
"""

from __future__ import annotations

import math
import warnings

import torch

from ..accelerator import Accelerator
from ..basics.norm import global_norm, squared_norm
from ..basics.precision import LOW_PRECISION, has_overflow, unscaled_fp32
from .buckets import GradientBuckets
from .comm import Comm
from .partition import Unit, build_units
from .stage3_gather import GatheredWeights

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


class ShardedStates(GatheredWeights):
    """Model states partitioned as ZeRO stage 1, 2 or 3 prescribes; the engine drives it step by step.

    Stage 3's gather, prefetch and release of units are inherited from stage3_gather.GatheredWeights."""

    def __init__(
        self, model: torch.nn.Module, accel: Accelerator, precision: str, stage: int, comm: Comm, zero
    ):
        if stage not in (1, 2, 3):
            raise ValueError(f"ShardedStates handles stages 1-3, got {stage}")
        self.accel, self.comm, self.stage, self.precision = accel, comm, stage, precision
        self.dtype = LOW_PRECISION[precision]
        self.units = build_units(model, comm.world_size, comm.rank)
        if not self.units:
            raise ValueError("the model has no trainable parameters")
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
        self.partition_gradients = self._partitions_gradients()
        initial = [p.detach() for p in self.params]  # the model's fp32 values, read before we rebind them
        self._allocate_weights(full_numel, shard_numel)
        self._allocate_gradients(full_numel, shard_numel)
        self._allocate_optimizer_states(shard_numel)
        self._initialise(initial)
        self._unit_of = {
            id(p): (index, i) for index, unit in enumerate(self.units) for i, p in enumerate(unit.params)
        }
        self.grad_shard_transient = None
        self._init_gathering(zero.stage3_prefetch_bucket_size)
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
                on_unit_complete=self.release if stage == 3 else None,
            )
            self.buckets.register_hooks()
        if stage == 3:
            self._install_gather_hooks(model, zero.leaf_module)

    # -- layout ----------------------------------------------------------------------------------------------
    def _split(self, flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return list(torch.split(flat, sizes))

    def _partitions_gradients(self) -> bool:
        return self.stage >= 2

    def _allocate_weights(self, full_numel: int, shard_numel: int) -> None:
        accel, low = self.accel, self.dtype
        if self.stage < 3:
            self.flat_param = accel.empty(full_numel, low, category="parameters")
            self.full_params = self._split(self.flat_param, [u.padded_numel for u in self.units])
            self.param_shards = [
                f[u.layout.start : u.layout.end] for f, u in zip(self.full_params, self.units, strict=True)
            ]
        else:
            self.flat_param = accel.empty(shard_numel, low, category="parameters")
            self.param_shards = self._split(self.flat_param, [u.shard_numel for u in self.units])
            self.full_params = []  # gather buffers: made one unit at a time in _initialise

    def _allocate_gradients(self, full_numel: int, shard_numel: int) -> None:
        if not self.partition_gradients:
            self.flat_grad = self.accel.zeros(full_numel, self.dtype, category="gradients")
            self.full_grads = self._split(self.flat_grad, [u.padded_numel for u in self.units])
        else:
            self.flat_grad = self.accel.zeros(shard_numel, self.dtype, category="gradients")
            self.grad_shards = self._split(self.flat_grad, [u.shard_numel for u in self.units])

    def _allocate_optimizer_states(self, shard_numel: int) -> None:
        accel, low = self.accel, self.dtype
        shard_sizes = [u.shard_numel for u in self.units]
        if low == torch.float32:
            self.master = None  # fp32 weights are their own master: the optimizer updates the weight shards
            self.master_params = self.param_shards
        else:
            self.master = accel.empty(shard_numel, torch.float32, category="master_weights")
            self.master_params = self._split(self.master, shard_sizes)
        self.exp_avg = accel.zeros(shard_numel, torch.float32, category="optimizer_states")
        self.exp_avg_sq = accel.zeros(shard_numel, torch.float32, category="optimizer_states")
        self.exp_avgs = self._split(self.exp_avg, shard_sizes)
        self.exp_avg_sqs = self._split(self.exp_avg_sq, shard_sizes)

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

    # -- stage 3: gather before use, release after (the rest is in stage3_gather.py) --------------------------
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
        # through. Mark the unit gathered and return the collective's handle. (release() frees it again.)
        self.accel.restore_storage(self.full_params[index], "parameters")
        work = all_gather_unit(self.comm, self.full_params[index], shard, async_op=async_op)
        unit.gathered = True
        return work
        # END LAB 2.4

    # -- stage 2/3: gradients leave in buckets as backward produces them (principles/buckets.py) ---------
    def _deliver_gradient(self, index: int, shard: torch.Tensor) -> None:
        self.grad_shards[index].add_(shard)  # accumulates over micro-batches

    # -- what the engine calls, in order -----------------------------------------------------------------------
    def before_forward(self) -> None:
        self._begin_phase("forward")

    def before_backward(self) -> None:
        self._begin_phase("backward")
        if not self.partition_gradients:
            for unit, full in zip(self.units, self.full_grads, strict=True):
                for param, offset, numel in zip(unit.params, unit.offsets, unit.numels, strict=True):
                    if param.grad is None:  # model.zero_grad() set it to None
                        param.grad = full[offset : offset + numel].view_as(param)

    def after_backward(self) -> None:
        """Reduce what backward left in buckets: the last bucket, and units with unused parameters."""
        if self.buckets is not None:
            self.buckets.finish()
        self._begin_phase("forward")

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

    def publish(self) -> None:
        """After the fp32 update: the new weights where forward will read them."""
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

    def record(self, ledger) -> None:
        ledger.record("parameters", self.flat_param)
        ledger.record("gradients", self.flat_grad)
        if self.master is not None:
            ledger.record("master_weights", self.master)
        ledger.record("exp_avg", self.exp_avg)
        ledger.record("exp_avg_sq", self.exp_avg_sq)

    def host_staging_bytes(self) -> int:
        """Host memory beyond the model states (staging buffers): none while everything lives on the device."""
        return 0

    def close(self) -> None:
        """Nothing of its own to stop: the engine's streams and the process group are the engine's."""
