"""Flatten parameters into contiguous buffers and cut each buffer into world-size shards.

ZeRO works on flat buffers: one contiguous run of elements per *unit* (the parameters of one module), padded so
that it splits into `world_size` equal shards. Rank r owns shard r of every unit. A shard may cut straight
through a parameter: rank 0 can own the first half of a weight matrix and rank 1 the rest, which is why we keep,
per rank, the list of parameter pieces ("slices") inside its shard.

Why per module? ZeRO-3 gathers a module's parameters just before its forward and frees them after; a unit is
exactly what one gather brings in. Stages 1 and 2 use the same units, so one layout serves every stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ALIGN = 8  # shard sizes are multiples of 8 elements (16 bytes of fp16): whole SIMD lanes for the CPU Adam


@dataclass(frozen=True)
class Slice:
    """One parameter's piece inside one rank's shard."""

    param: int  # index of the parameter in its unit
    param_start: int  # first element of the piece within the flattened parameter
    shard_start: int  # where the piece starts within the shard
    numel: int


@dataclass(frozen=True)
class ShardLayout:
    padded_numel: int  # the unit's flat buffer, padded to world_size equal shards
    shard_numel: int
    start: int  # this rank's shard is [start, end) of the unit's flat buffer
    end: int
    slices: tuple[Slice, ...]  # the parameter pieces inside [start, end), in order


def shard_layout(numels: list[int], world_size: int, rank: int, align: int = ALIGN) -> ShardLayout:
    """Where rank `rank`'s shard lies in a flat buffer holding parameters of sizes `numels`, back to back."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    # BEGIN LAB 2.1: shard sizes and the parameter pieces inside one rank's shard
    # The flat buffer holds sum(numels) elements; pad it up so it splits into world_size equal shards whose size
    # is a multiple of `align` (shard_numel = align * ceil(total / (world_size * align))). Rank r owns
    # [r * shard_numel, (r + 1) * shard_numel). Walk the parameters (each starts where the previous one ended)
    # and record, for each one that overlaps the shard, a Slice: the parameter's index, where the overlap
    # starts inside the parameter, where it starts inside the shard, and its length. Padding gets no Slice.
    total = sum(numels)
    shard_numel = align * math.ceil(total / (world_size * align))
    start, end = rank * shard_numel, (rank + 1) * shard_numel
    slices = []
    offset = 0
    for index, numel in enumerate(numels):
        lo, hi = max(offset, start), min(offset + numel, end)
        if lo < hi:
            slices.append(Slice(index, lo - offset, lo - start, hi - lo))
        offset += numel
    # END LAB 2.1
    return ShardLayout(shard_numel * world_size, shard_numel, start, end, tuple(slices))


class Unit:
    """The parameters of one module, flattened: what ZeRO-3 gathers and releases together."""

    def __init__(
        self, name: str, params: list[torch.nn.Parameter], world_size: int, rank: int, *, group: int = 0
    ):
        self.name, self.params = name, params
        self.group = group  # the parameter group (engine/param_groups.py) whose settings Adam uses on it
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.layout = shard_layout(self.numels, world_size, rank)
        self.padded_numel, self.shard_numel = self.layout.padded_numel, self.layout.shard_numel

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, {len(self.params)} params, {self.numel} elements)"


def build_units(
    model: torch.nn.Module, world_size: int, rank: int, group_of: dict[int, int] | None = None
) -> list[Unit]:
    """One unit per module that registers trainable parameters, in registration order.

    A tied parameter (the embedding reused as the output head) joins the unit of the first module that
    registers it, and only that one: it is stored, reduced and updated once. With parameter groups
    (`group_of`: id(param) -> group), a module whose parameters fall in several groups gets one unit per
    group, in the order of the groups, so that each unit's Adam settings are one group's.
    """
    seen: set[int] = set()
    units = []
    for name, module in model.named_modules():
        by_group: dict[int, list] = {}
        for param in module.parameters(recurse=False):
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                group = 0 if group_of is None else group_of[id(param)]
                by_group.setdefault(group, []).append(param)
        for group in sorted(by_group):
            label = name or "<root>"
            if len(by_group) > 1:
                label = f"{label} (group {group})"
            units.append(Unit(label, by_group[group], world_size, rank, group=group))
    return units
