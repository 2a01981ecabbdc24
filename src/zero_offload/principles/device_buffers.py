"""Where ZeRO stages 1-3 keep one rank's model states when none of them leaves the device.

ShardedStates (zero.py) is given one of these placements and works on the views it made; module 3's
host_buffers.HostBuffers is the other placement, with the optimizer's half on the host. Each answers the two
questions the memory report asks: which tensors hold which state (`record`), and how much host memory the
staging buffers take (`host_staging_bytes`).

Per unit there is one view into each flat buffer, so a collective or Adam can work unit by unit while the
ledger counts one storage per state.
"""

from __future__ import annotations

import torch

from ..accelerator import Accelerator
from .partition import Unit


def split_flat(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Views of consecutive pieces of `flat`, one per size."""
    return list(torch.split(flat, sizes))


def device_weights(units: list[Unit], accel: Accelerator, dtype: torch.dtype, stage: int):
    """(flat_param, full_params, param_shards): the fp16/bf16 weights forward reads, on the device.

    Stages 1 and 2 hold every unit's full weights; a rank's shard is a view into them. Stage 3 holds only the
    shards; `full_params` starts empty and ShardedStates makes each unit's gather buffer while it sets up."""
    if stage < 3:
        flat = accel.empty(sum(u.padded_numel for u in units), dtype, category="parameters")
        full = split_flat(flat, [u.padded_numel for u in units])
        shards = [f[u.layout.start : u.layout.end] for f, u in zip(full, units, strict=True)]
        return flat, full, shards
    flat = accel.empty(sum(u.shard_numel for u in units), dtype, category="parameters")
    return flat, [], split_flat(flat, [u.shard_numel for u in units])


class DeviceBuffers:
    """Every buffer of this rank's model states on the device: weights, gradients, fp32 master, m and v.

    Allocated in the order a GPU fills up (weights, gradients, then the optimizer's fp32 states), so that an
    out-of-memory error names the states offloading would move."""

    def __init__(
        self,
        units: list[Unit],
        accel: Accelerator,
        dtype: torch.dtype,
        *,
        stage: int,
        partition_gradients: bool,
    ):
        self.flat_param, self.full_params, self.param_shards = device_weights(units, accel, dtype, stage)
        full_sizes = [u.padded_numel for u in units]
        shard_sizes = [u.shard_numel for u in units]
        # Stage 1 keeps full gradients (reduced at the step); from stage 2 on only this rank's shard stays.
        self.full_grads = self.grad_shards = None
        if not partition_gradients:
            self.flat_grad = accel.zeros(sum(full_sizes), dtype, category="gradients")
            self.full_grads = split_flat(self.flat_grad, full_sizes)
        else:
            self.flat_grad = accel.zeros(sum(shard_sizes), dtype, category="gradients")
            self.grad_shards = split_flat(self.flat_grad, shard_sizes)
        if dtype == torch.float32:
            self.master = None  # fp32 weights are their own master: the optimizer updates the weight shards
            self.master_params = self.param_shards
        else:
            self.master = accel.empty(sum(shard_sizes), torch.float32, category="master_weights")
            self.master_params = split_flat(self.master, shard_sizes)
        self.exp_avg = accel.zeros(sum(shard_sizes), torch.float32, category="optimizer_states")
        self.exp_avg_sq = accel.zeros(sum(shard_sizes), torch.float32, category="optimizer_states")
        self.exp_avgs = split_flat(self.exp_avg, shard_sizes)
        self.exp_avg_sqs = split_flat(self.exp_avg_sq, shard_sizes)
        # fp32 moments have no scales; module 4's int8 moments on the host keep one per block.
        self.exp_avg_scales = self.exp_avg_sq_scales = [None] * len(shard_sizes)

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
