"""Partial offload: `offload_optimizer.ratio` runs that share of the optimizer step on the host, the rest on the device.

A whole offload moves 16 bytes a parameter of optimizer states and gradients to the host and makes the CPU do
all of Adam. When the device has memory to spare and the CPU step is the slower side, keeping some units'
optimizer states on the device (and updating them there) trades device memory for CPU time. DeepSpeed has the
key for ZeRO-3; here it works at stages 1-3.

The split is by unit (the parameters of one module; see principles/partition.py), in model order: the leading
units whose share of this rank's optimizer states comes closest to `ratio` keep theirs on the host, the others
on the device. Whole units keep each unit's buffers contiguous, so every part of the step still runs over a
flat range. The results are the same either way: it is the same Adam on the same fp32 numbers.
"""

from __future__ import annotations

import math

import torch

from ..basics.memory import ModelStateBytes, estimate_model_states, moment_bytes
from ..implementation.offload import adam_step
from ..implementation.updaters import Update


def host_unit_count(shard_sizes: list[int], ratio: float) -> int:
    """How many leading units keep their optimizer states on the host for offload `ratio` (0 < ratio <= 1).

    The engine gives the count to module 3's OffloadedStates (its `host_units`), which keeps those units'
    optimizer states on the host and the others, updated there, on the device."""
    target = ratio * sum(shard_sizes)
    best, best_gap, running = 0, target, 0
    for count, size in enumerate(shard_sizes, start=1):
        running += size
        gap = abs(running - target)
        if gap <= best_gap:  # on a tie, more on the host: the ratio names the host's share
            best, best_gap = count, gap
    return best


class DevicePartUpdater:
    """The units a partial offload keeps on the device, updated there by `optimizer`, after the host's units."""

    norm_in_adam = False

    def __init__(self, states, optimizer: torch.optim.Optimizer, first_unit: int, *, timeline):
        self.states, self.optimizer, self.first, self.timeline = states, optimizer, first_unit, timeline

    def update(self, grads: list[torch.Tensor], clip_factor: float, norms=None) -> Update:
        with self.timeline.adam():
            masters = self.states.master_params[self.first :]
            adam_step(self.optimizer, masters, grads[self.first :], clip_factor)
        return Update(0.0)  # what the report calls Adam's seconds is the host's; publish() rounds these units


def estimate_partial_offload(
    num_params: int,
    *,
    stage: int,
    world_size: int,
    precision: str,
    host_fraction: float,
    moments: str = "fp32",
) -> ModelStateBytes:
    """`estimate_model_states` with offload_optimizer "cpu", then the device's share moved back to the device.

    Per element kept on the device: its gradient stays in the training precision (2 or 4 bytes) instead of the
    host's fp32 copy, and master weight (none in fp32: the device weights are their own master), m and v sit
    in device memory. `moments`: the host's m and v ("bf16", "int8"); the device's stay fp32, for torch's Adam.
    """
    result = estimate_model_states(
        num_params, stage=stage, world_size=world_size, offload_optimizer="cpu", precision=precision
    )
    shard = math.ceil(num_params / world_size)
    on_device = shard - round(shard * host_fraction)
    low = 4 if precision == "fp32" else 2
    moved = {"gradients": (4, low), "master_weights": (4, 0 if precision == "fp32" else 4)}
    moved.update({"exp_avg": (4, 4), "exp_avg_sq": (4, 4)})
    for state, (host_bytes, device_bytes) in moved.items():
        result.add(state, "host", -host_bytes * on_device)
        result.add(state, "device", device_bytes * on_device)
    if moments != "fp32":  # what stays on the host of m and v, in its own precision
        for state in ("exp_avg", "exp_avg_sq"):
            result.bytes[state]["host"] = moment_bytes(shard - on_device, moments)
    return result


class SplitOptimizer:
    """The host's Adam and the device's Adam as one optimizer for the schedule, the history and checkpoints.

    `param_groups` lists both optimizers' groups (the same dicts, so a schedule that writes an lr reaches both);
    `state` finds any parameter's moments in whichever optimizer holds it. It has no step(): the engine steps
    the two parts itself, each over its own units.
    """

    def __init__(self, host: torch.optim.Optimizer | None, device: torch.optim.Optimizer | None):
        parts = [part for part in (host, device) if part is not None]
        self.param_groups = [group for part in parts for group in part.param_groups]
        self.state = {param: state for part in parts for param, state in part.state.items()}


def estimate_for_config(config, num_params: int, states) -> ModelStateBytes:
    """What `config` should hold of each model state, per tier: module 1's estimate, or with a partial offload
    this one, from the share of the optimizer states `states` really put on the host."""
    zero = config.zero_optimization
    if zero.offload_optimizer.enabled and zero.offload_optimizer.ratio < 1.0:
        return estimate_partial_offload(
            num_params,
            stage=zero.stage,
            world_size=config.world_size,
            precision=config.precision,
            host_fraction=states.host_fraction,
            moments=config.zero_offload.cpu_adam.states,
        )
    return estimate_model_states(
        num_params,
        stage=zero.stage,
        world_size=config.world_size,
        offload_optimizer=zero.offload_optimizer.device,
        offload_param=zero.offload_param.device,
        precision=config.precision,
        moments=config.zero_offload.cpu_adam.states,
    )
