"""How many bytes the model states take, per tier: estimated from the parameter count, and measured.

Mixed-precision Adam (fp16 or bf16) keeps, per parameter:

    fp16 weight 2  +  fp16 gradient 2  +  fp32 master weight 4  +  fp32 momentum 4  +  fp32 variance 4  =  16 bytes

so a 13B-parameter model needs 13e9 * 16 = 208 GB of model states before a single activation (the course
introduction's 156 GB counts 12 bytes and forgets the master weights). In fp32 training the weights are their
own master: 4 + 4 + 4 + 4 = 16 bytes again, with no separate copy.

ZeRO divides states by the world size N:    stage 1 the optimizer states (master, m, v),
                                            stage 2 also the gradients,  stage 3 also the weights.
ZeRO-Offload moves states to the host:      offload_optimizer: master, m, v, and the gradient partition, which
                                            the host keeps in fp32 (4 bytes) for the CPU Adam; the device keeps
                                            only the weights (gradients leave it bucket by bucket);
                                            offload_param (stage 3): the weight shards too.
So with stage 2 and CPU offload the host holds 4 + 4 + 4 + 4 = 16 bytes per parameter of its shard; in fp32
training too, because the host's master copy is separate from the weights the device computes with.

`estimate_model_states` computes these numbers; `MemoryLedger` measures the same quantities from the storage of
the tensors the engine really allocated. Shards are rounded up to whole elements (ceil(P / N)); the engine's
partitions may pad a little more (the padding is reported by the engine, never hidden).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ..accelerator.host_allocator import plan_of
from ..units import format_bytes

TIERS = ("device", "host", "nvme")
STATES = ("parameters", "gradients", "master_weights", "exp_avg", "exp_avg_sq")
PRECISIONS = ("fp16", "bf16", "fp32")
# Adam's m and v below fp32: bf16 (2 bytes), or 8 bits in blocks of QUANT_BLOCK elements with an fp32 scale each.
MOMENT_PRECISIONS = ("fp32", "bf16", "int8")
QUANT_BLOCK = 2048
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass
class ModelStateBytes:
    """Bytes of each model state in each tier: `bytes[state][tier]`."""

    bytes: dict[str, dict[str, int]] = field(
        default_factory=lambda: {s: dict.fromkeys(TIERS, 0) for s in STATES}
    )

    def add(self, state: str, tier: str, nbytes: int) -> None:
        self.bytes[state][tier] += int(nbytes)

    def tier(self, tier: str) -> int:
        return sum(per_tier[tier] for per_tier in self.bytes.values())

    @property
    def device(self) -> int:
        return self.tier("device")

    @property
    def host(self) -> int:
        return self.tier("host")

    @property
    def nvme(self) -> int:
        return self.tier("nvme")

    @property
    def total(self) -> int:
        return self.device + self.host + self.nvme

    def as_dict(self) -> dict[str, int]:
        return {tier: self.tier(tier) for tier in TIERS}

    def table(self) -> str:
        rows = [f"{'state':<16}" + "".join(f"{t:>14}" for t in TIERS)]
        for state, per_tier in self.bytes.items():
            rows.append(f"{state:<16}" + "".join(f"{format_bytes(per_tier[t]):>14}" for t in TIERS))
        rows.append(f"{'total':<16}" + "".join(f"{format_bytes(self.tier(t)):>14}" for t in TIERS))
        return "\n".join(rows)


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def estimate_model_states(
    num_params: int,
    *,
    stage: int = 0,
    world_size: int = 1,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    precision: str = "fp16",
    moments: str = "fp32",
) -> ModelStateBytes:
    """Bytes of model states on one rank, per tier, for Adam with the given ZeRO stage and offload choices.

    Per parameter (P parameters, N ranks, shard = ceil(P / N)):
        fp16/bf16: weight 2, gradient 2, master weight 4, exp_avg 4, exp_avg_sq 4   -> 16 bytes
        fp32:      weight 4, gradient 4, (no separate master), exp_avg 4, exp_avg_sq 4 -> 16 bytes
                   (with offload_optimizer the host keeps a separate fp32 master: 4 more bytes)
    stage >= 1 shards master/exp_avg/exp_avg_sq, stage >= 2 the gradients, stage 3 the weights.
    offload_optimizer ('cpu' or 'nvme'): master/exp_avg/exp_avg_sq go to that tier; the gradient partition goes to
        the host in fp32 (4 bytes); the device keeps no gradient between steps.
    offload_param ('cpu' or 'nvme', stage 3 only): the weight shard goes to that tier.
    moments ('fp32', 'bf16' or 'int8'): the precision of exp_avg and exp_avg_sq (`moment_bytes`).
    """
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("stage", stage, (0, 1, 2, 3))
    _check_choice("offload_optimizer", offload_optimizer, OFFLOAD_DEVICES)
    _check_choice("offload_param", offload_param, OFFLOAD_DEVICES)
    _check_choice("moments", moments, MOMENT_PRECISIONS)
    if not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params must be a non-negative int, got {num_params!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if offload_optimizer != "none" and stage == 0:
        raise ValueError(
            "offload_optimizer needs ZeRO stage >= 1 (use stage 2: on one GPU it offloads everything)"
        )
    if offload_param != "none" and stage != 3:
        raise ValueError("offload_param needs ZeRO stage 3: below it every rank keeps the full weights")
    result = ModelStateBytes()
    # BEGIN LAB 1.3: bytes of each model state in each tier
    # Weights and gradients take 2 bytes in fp16/bf16 and 4 in fp32. fp16/bf16 runs keep a 4-byte master weight;
    # fp32 runs keep none unless the optimizer is offloaded (the host then needs its own fp32 copy).
    # exp_avg and exp_avg_sq take 4 bytes each.
    # Count P elements for a full copy and shard = ceil(P / N) for a partitioned one, per the stage.
    # Offloaded states go to the "host" tier for 'cpu' and the "nvme" tier for 'nvme'; the offloaded gradient
    # partition is fp32 on the host. Record each with result.add(state, tier, nbytes).
    tier_of = {"none": "device", "cpu": "host", "nvme": "nvme"}
    low = 4 if precision == "fp32" else 2
    shard = math.ceil(num_params / world_size)
    weights = shard if stage == 3 else num_params
    result.add("parameters", tier_of[offload_param], low * weights)
    if offload_optimizer == "none":
        result.add("gradients", "device", low * (shard if stage >= 2 else num_params))
    else:
        result.add("gradients", "host", 4 * shard)
    states = shard if stage >= 1 else num_params
    optimizer_tier = tier_of[offload_optimizer]
    if precision != "fp32" or offload_optimizer != "none":
        result.add("master_weights", optimizer_tier, 4 * states)
    result.add("exp_avg", optimizer_tier, 4 * states)
    result.add("exp_avg_sq", optimizer_tier, 4 * states)
    # END LAB 1.3
    if moments != "fp32":  # Lab 1.3 counts fp32 moments; below fp32 each keeps fewer bytes, where they are
        partitioned = math.ceil(num_params / world_size) if stage >= 1 else num_params
        for state in ("exp_avg", "exp_avg_sq"):
            for tier, nbytes in result.bytes[state].items():
                if nbytes:
                    result.bytes[state][tier] = moment_bytes(partitioned, moments)
    return result


def moment_bytes(numel: int, precision: str = "fp32") -> int:
    """Bytes of one Adam moment of `numel` elements: 4 each in fp32, 2 in bf16; in int8 1 each plus a 4-byte
    scale per block of QUANT_BLOCK (2048) elements, 1.002 bytes an element."""
    _check_choice("moments", precision, MOMENT_PRECISIONS)
    if precision == "int8":
        return numel + 4 * math.ceil(numel / QUANT_BLOCK)
    return {"fp32": 4, "bf16": 2}[precision] * numel


# How the engine stores each moment precision: the dtypes of exp_avg and exp_avg_sq (int8 v holds unsigned codes
# of sqrt(v), module 4's tuning/state_precision.py), and whether each unit has one fp32 scale per block.
MOMENT_DTYPES = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "int8": (torch.int8, torch.uint8),
}


def moment_scales(numel: int, precision: str) -> int:
    """The fp32 scales one moment of `numel` elements keeps: one per block of QUANT_BLOCK in int8, else none."""
    _check_choice("moments", precision, MOMENT_PRECISIONS)
    return math.ceil(numel / QUANT_BLOCK) if precision == "int8" else 0


def pinned_block_bytes(nbytes: int) -> int:
    """What torch's pinned-memory caching allocator really takes for a request of `nbytes`: the next power of
    two, so that freed blocks fit later requests (ATen's CachingHostAllocator, torch 2.13). A 300 MB pinned
    buffer would hold 512 MB of locked memory; the engine's own buffers of 16 MiB and more therefore bypass it
    (accelerator/host_allocator.py's `pinned_plan`)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 1 else nbytes


def held_bytes(tensor: torch.Tensor) -> int:
    """Bytes the storage of `tensor` really holds. A pinned buffer made by an accelerator: what its plan locks
    (accelerator/host_allocator.py's `pinned_plan`; on the emulated device, what a GPU would lock). Other pinned
    memory: rounded as torch's pinned allocator rounds it."""
    plan = plan_of(tensor) if tensor.device.type == "cpu" else None
    if plan is not None:
        return plan.locked_bytes
    nbytes = tensor.untyped_storage().nbytes()
    return pinned_block_bytes(nbytes) if tensor.device.type == "cpu" and tensor.is_pinned() else nbytes


class MemoryLedger:
    """Measures model-state bytes from the tensors (and swap files) that really hold them.

    The engine records every buffer it allocates under the state it holds. A storage recorded twice (the fp32
    weights that are their own master) is counted once. The tier comes from where the storage lives: the device
    (as the accelerator tells it), host memory, or a file on the NVMe tier.
    """

    def __init__(self, accelerator=None, *, device: torch.device | str | None = None):
        # Without an accelerator, tensors on `device` count as device memory and all others as host memory.
        self.accelerator = accelerator
        self.device = torch.device(device) if device is not None else None
        self._tensors: list[tuple[str, torch.Tensor]] = []
        self._files: list[tuple[str, str]] = []

    def record(self, state: str, tensors: torch.Tensor | Iterable[torch.Tensor]) -> None:
        _check_choice("state", state, STATES)
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        self._tensors.extend((state, t) for t in tensors)

    def record_file(self, state: str, path: str | os.PathLike) -> None:
        _check_choice("state", state, STATES)
        self._files.append((state, os.fspath(path)))

    def _tier(self, tensor: torch.Tensor) -> str:
        if self.accelerator is not None:
            return "device" if self.accelerator.is_on_device(tensor) else "host"
        if self.device is not None:
            return "device" if tensor.device == self.device else "host"
        return "host" if tensor.device.type == "cpu" else "device"

    def measure(self) -> ModelStateBytes:
        result = ModelStateBytes()
        seen: set[tuple[str, int]] = set()
        for state, tensor in self._tensors:
            storage = tensor.untyped_storage()
            key = (tensor.device.type, storage.data_ptr())
            if key in seen:
                continue
            seen.add(key)
            result.add(state, self._tier(tensor), held_bytes(tensor))
        for state, path in self._files:
            result.add(state, "nvme", os.path.getsize(path) if os.path.exists(path) else 0)
        return result

    @classmethod
    def from_torch(
        cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> MemoryLedger:
        """A ledger over a plain PyTorch model and optimizer (no engine): weights, .grad, exp_avg, exp_avg_sq.

        The model's own device is the "device" tier, even when that is the CPU.
        """
        params = list(model.parameters())
        ledger = cls(device=params[0].device if params else None)
        ledger.record("parameters", params)
        ledger.record("gradients", [p.grad for p in params if p.grad is not None])
        if optimizer is not None:
            for state in optimizer.state.values():
                for name in ("exp_avg", "exp_avg_sq"):
                    if name in state:
                        ledger.record(name, state[name])
        return ledger


@dataclass
class MemoryReport:
    """What `engine.memory_report()` returns: model states per tier, estimated and measured, and the device."""

    estimated: ModelStateBytes
    measured: ModelStateBytes
    device: object  # accelerator.MemoryStats
    accelerator: str
    num_params: int
    # Offload: the fp16 host buffers gradients and weights pass through (not model states).
    host_staging: int = 0
    # Elements of the fp32 master weights this rank keeps (its shard); 0: unknown, the model's count is used.
    optimizer_numel: int = 0

    def optimizer_bytes_per_param(self) -> dict[str, float]:
        """Measured bytes of the fp32 master weights and Adam's m and v per parameter of this rank's shard, in
        each tier: 12 with fp32 moments, 8 with bf16, about 6 with 8-bit ones and their scales (module 4)."""
        states = ("master_weights", "exp_avg", "exp_avg_sq")
        count = max(self.optimizer_numel or self.num_params, 1)
        return {tier: sum(self.measured.bytes[s][tier] for s in states) / count for tier in TIERS}

    def __str__(self) -> str:
        lines = [
            f"Model states of {self.num_params:,} parameters ({self.accelerator} device)",
            f"{'tier':<8}{'estimated':>14}{'measured':>14}",
        ]
        for tier in TIERS:
            lines.append(
                f"{tier:<8}{format_bytes(self.estimated.tier(tier)):>14}"
                f"{format_bytes(self.measured.tier(tier)):>14}"
            )
        if self.host_staging:
            lines.append(f"host staging buffers {format_bytes(self.host_staging)} (fp16 copies on their way)")
        optimizer = self.optimizer_bytes_per_param()
        for tier in (t for t in ("host", "nvme") if optimizer[t]):
            lines.append(
                f"optimizer states in {tier}: {optimizer[tier]:.3f} bytes a parameter of this rank's shard "
                "(fp32 master, m and v)"
            )
        budget = "unlimited" if self.device.capacity is None else format_bytes(self.device.capacity)
        lines.append(
            f"device now {format_bytes(self.device.in_use)}, peak {format_bytes(self.device.peak)}, "
            f"reserved {format_bytes(self.device.reserved)}, budget {budget} "
            "(peak includes activations and transient buffers; the budget caps what is reserved)"
        )
        return "\n".join(lines)
