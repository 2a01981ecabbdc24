"""Where the model states live: the states object the config picks, one per module.

    stage 0                              module 1's MixedPrecisionStates: everything on the device, replicated
    stages 1-3                           module 2's ShardedStates: sharded across ranks, all on the device
    stages 1-3 + offload_optimizer       module 3's OffloadedStates: the fp32 optimizer half on the host
      ... with ratio < 1                 module 4's host_unit_count: only that many units on the host
      ... with device "nvme"             module 5's NVMeStates: that half in files, a few sub-groups in memory

Each answers the same questions (reduce the gradients, report an overflow, give the fp32 gradients, publish
the new weights): `States` below writes them down. Who runs Adam over them, and when, is optimizer_step.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch

from ..accelerator import Accelerator
from ..basics.precision import MixedPrecisionStates
from ..config import Config
from ..implementation.offload import OffloadedStates
from ..practice.nvme import NVMeStates
from ..principles.comm import Comm
from ..principles.partition import build_units
from ..principles.zero import ShardedStates
from ..tuning.partial import host_unit_count
from .param_groups import ParamGroups


class States(Protocol):
    """What the engine, its updaters and checkpoints ask of every states object, in the order of a step.

    The tiers add what their own parts need (OffloadedStates' `host_units`, the NVMe tier's files); the rest
    of the engine asks only this."""

    params: list[torch.nn.Parameter]  # the unique trainable parameters, whose .data the states own
    numel: int
    dtype: torch.dtype  # the training precision of the weights forward reads
    # The fp32 pieces the optimizer updates (views; the NVMe tier's are valid while in their slot), and the
    # parameter group of each (engine/param_groups.py).
    master_params: list[torch.Tensor]
    master_groups: list[int]
    # implementation.transfers.Transfers once offloaded (the PCIe bytes counted), else None.
    transfers: object | None
    # Stage 3: principles.stage3_gather.UnitGathering, else None (every rank holds the full weights).
    gathering: object | None

    def before_forward(self) -> None: ...
    def before_backward(self) -> None: ...
    def after_backward(self) -> None: ...
    def reduce_gradients(self) -> None: ...
    def overflow(self) -> bool: ...
    def fp32_gradients(self, inv_scale: float) -> list[torch.Tensor]: ...
    def grad_norm(self, grads: list[torch.Tensor]) -> float: ...

    def publish(self, *, rounded: bool = False) -> None:
        """The new weights where forward reads them; `rounded`: the host's Adam already rounded them."""

    def zero_grad(self) -> None: ...
    def record(self, ledger) -> None: ...
    def host_staging_bytes(self) -> int: ...
    def close(self) -> None: ...

    def each_unit(self, *, write: bool = False) -> Iterator[int]:
        """The index of each master piece, readable (and with `write`, writable) until the next index."""

    def gathered(self, params=None, *, modifier_rank: int | None = None) -> contextlib.AbstractContextManager:
        """Full weights of `params` until the block ends; with `modifier_rank`, that rank's edits adopted."""


def build_states(
    model: torch.nn.Module, config: Config, accel: Accelerator, comm: Comm, *, loss_scale, groups: ParamGroups
) -> States:
    """The states of `model`'s trainable parameters, each unit in one of the parameter `groups`;
    `loss_scale()` is the current loss scale, which the offloaded states divide the gradients by on their way
    to the host."""
    zero, group_of = config.zero_optimization, groups.unit_groups()
    if zero.stage == 0:
        # In the units' order, and the norm summed unit by unit, as the other stages do: one rank gets the same
        # number. A group's parameters are consecutive within a unit, so each run of them is one master piece.
        units = build_units(model, 1, 0, group_of)
        params = [p for unit in units for p in unit.params]
        return MixedPrecisionStates(
            params,
            accel,
            config.precision,
            comm,
            norm_pieces=[unit.numel for unit in units],
            groups=None if group_of is None else [unit.group for unit in units for _ in unit.params],
        )
    if not zero.offload_optimizer.enabled:
        return ShardedStates(model, accel, config.precision, zero.stage, comm, zero, group_of=group_of)
    tier, placement = OffloadedStates, {"group_of": group_of, "moments": config.zero_offload.cpu_adam.states}
    if zero.offload_optimizer.device == "nvme":  # module 5
        tier = NVMeStates
    elif zero.offload_optimizer.ratio < 1.0:  # module 4: the leading units closest to the ratio on the host
        sizes = [unit.shard_numel for unit in build_units(model, comm.world_size, comm.rank, group_of)]
        placement["host_units"] = host_unit_count(sizes, zero.offload_optimizer.ratio)
    return tier(
        model,
        accel,
        config.precision,
        zero.stage,
        comm,
        zero,
        loss_scale=loss_scale,
        pipelined=config.zero_offload.overlap_offload,
        **placement,
    )
