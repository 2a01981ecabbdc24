"""What a loaded config is: frozen dataclasses, one per section, and the error that reading one raises.

Each field is a setting the engine reads. A DeepSpeed key the engine accepts but has no use for gets no field:
the reader warns about it instead (load.py), so that nothing here looks like a knob that does nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration problem; `.path` is the key path, e.g. "zero_optimization.offload_param.device"."""

    def __init__(self, path: str, message: str):
        self.path = path
        # Every message must name its key, even one written carelessly later.
        super().__init__(message if not path or path in message else f"{path}: {message}")

    def __reduce__(self):  # so that an error raised in a spawned rank survives the trip back
        return ConfigError, (self.path, str(self))


class FrozenDict(dict):
    """A read-only dict: a frozen dataclass can hold it, hash it, pickle it and index it by key."""

    def _read_only(self, *args, **kwargs):
        raise TypeError("configuration values are read-only; build a new config with load_config")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.items())))

    def __reduce__(self):  # pickle would otherwise refill it through the blocked __setitem__
        return FrozenDict, (dict(self),)


@dataclass(frozen=True)
class FP16Config:
    enabled: bool = False
    loss_scale: float = 0.0  # 0 selects dynamic loss scaling, any other value is a fixed scale
    initial_scale_power: int = 16  # the dynamic scale starts at 2**initial_scale_power
    loss_scale_window: int = 1000  # overflow-free steps before the scale doubles
    hysteresis: int = 2  # overflows tolerated before the scale halves
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0


@dataclass(frozen=True)
class BF16Config:
    enabled: bool = False


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_w_mode: bool = True
    bias_correction: bool = True

    @property
    def adamw(self) -> bool:
        """Decoupled weight decay. DeepSpeed's "Adam" is AdamW too unless params.adam_w_mode is false."""
        return self.adam_w_mode


@dataclass(frozen=True)
class SchedulerConfig:
    type: str | None = None
    params: Mapping[str, Any] = field(default_factory=FrozenDict)


@dataclass(frozen=True)
class OffloadConfig:
    device: str = "none"  # "none" | "cpu" | "nvme"
    nvme_path: str | None = None
    # False, as DeepSpeed's was up to v0.19.4; from v0.19.5 DeepSpeed pins by default. Write it out to match.
    pin_memory: bool = False
    buffer_count: int = 4
    ratio: float = 1.0  # share of the optimizer step done on the CPU (offload_optimizer only)

    @property
    def enabled(self) -> bool:
        return self.device != "none"


# DeepSpeed's default leaf modules: the Hugging Face mixture-of-experts blocks, whose experts each rank runs or
# skips by its own tokens' routing.
DEFAULT_LEAF_CLASSES = ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock")


@dataclass(frozen=True)
class LeafModuleConfig:
    # Stage 3 gathers a leaf module's whole subtree when it is entered, so that every rank gathers the same
    # units whichever of its children its data runs (principles/stage3_params.py). Matched by class name
    # (plain or with its module path), by the module's name in named_modules(), or by a suffix of that name.
    classes: tuple[str, ...] = DEFAULT_LEAF_CLASSES
    names: tuple[str, ...] = ()
    name_suffixes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = 0
    offload_optimizer: OffloadConfig = OffloadConfig()
    offload_param: OffloadConfig = OffloadConfig()
    overlap_comm: bool = False
    reduce_bucket_size: int = 500_000_000  # elements, not bytes (DeepSpeed's unit)
    stage3_prefetch_bucket_size: int = (
        50_000_000  # elements stage 3 gathers ahead of use (DeepSpeed's default)
    )
    sub_group_size: int = 1_000_000_000
    leaf_module: LeafModuleConfig = LeafModuleConfig()


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    # True when the JSON has an "activation_checkpointing" section: the engine recomputes every block.
    # DeepSpeed's other keys in it change nothing here, so they are not fields.
    enabled: bool = False


@dataclass(frozen=True)
class CpuAdamConfig:
    # The Adam of an offloaded optimizer: the C kernel ("simd"), torch's fused Adam, or module 1's naive one.
    # Optimizer states on the device are always updated by torch's fused Adam (or the naive one, if chosen).
    impl: str = "simd"  # "simd" | "torch" | "naive"
    threads: int | None = None  # None: let the implementation choose
    # The C kernel's loop: "fastest" (each one this CPU runs timed once, the fastest kept: tuning/variant_choice.py),
    # "widest" (the widest this CPU runs) or one by name, e.g. "scalar" to stand in for a CPU without SIMD (the
    # same bytes, several times the time: `make bench`'s host-bound setting).
    variant: str = "fastest"  # "fastest" | "widest" | "scalar" | "avx2" | "avx512"
    # How the host's Adam stores m and v (module 4, tuning/state_precision.py): "fp32"; "bf16" (rounded to
    # nearest even); "int8" (8-bit codes with an fp32 scale per block of 2048; v as codes of sqrt v). The fp32
    # master weights stay fp32. Below fp32 only the C Adam ("impl": "simd") can run them.
    states: str = "fp32"  # "fp32" | "bf16" | "int8"


@dataclass(frozen=True)
class DelayedParamUpdateConfig:
    enabled: bool = False
    # The first steps run synchronously: early updates are large and must not lag. 40 is the paper's warm-up;
    # course/measured/dpu-warmup.txt (chapter 6A) measured 10 costing three times as much loss as 40.
    start_step: int = 40


@dataclass(frozen=True)
class CoresConfig:
    # CPU cores for the emulated device's compute (the main thread, torch's ops) and for the host's work (the
    # pipeline's queue, the C Adam's threads). Empty: no pinning. A GPU and a CPU are separate processors;
    # on a machine with only CPUs this keeps the two from taking each other's cores.
    device: tuple[int, ...] = ()
    host: tuple[int, ...] = ()


@dataclass(frozen=True)
class ExtensionConfig:
    device_memory: int | None = None  # bytes; None: the real device's size, or ZO_DEVICE_MEMORY
    cpu_adam: CpuAdamConfig = CpuAdamConfig()
    overlap_offload: bool = False  # module 5's pipeline (practice/pipeline.py); off: module 3's serial step
    # The pipeline's host staging buffers per direction: 2 is double buffering; more let backward run ahead
    # when the host falls behind for a few units, at the price of that many more device shards kept alive.
    staging_slots: int = 2
    delayed_param_update: DelayedParamUpdateConfig = DelayedParamUpdateConfig()
    cores: CoresConfig = CoresConfig()
    # Skipped steps in a row (non-finite loss or gradient norm; fp16 overflow once the scale is at its floor)
    # after which the run stops with TrainingDivergedError (engine/divergence.py) rather than train on nothing.
    max_skipped_steps: int = 20


@dataclass(frozen=True)
class Config:
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int = 1
    gradient_clipping: float = 0.0  # max global gradient norm; 0 turns clipping off
    fp16: FP16Config = FP16Config()
    bf16: BF16Config = BF16Config()
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    zero_optimization: ZeroConfig = ZeroConfig()
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    zero_offload: ExtensionConfig = ExtensionConfig()
    # The data loader zero_offload.deepspeed.initialize builds from training_data drops a last, short batch.
    dataloader_drop_last: bool = False
    # The user's own dict, kept so that load_config(cfg, world_size=n) can derive batch sizes afresh.
    source: Mapping | None = field(default=None, compare=False, hash=False, repr=False)

    @property
    def precision(self) -> str:
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @property
    def torch_dtype(self):
        import torch  # imported here so that reading a config (the CLI's `plan`) does not load torch

        return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[self.precision]

    def to_dict(self) -> dict:
        """Canonical JSON form with every default filled in; load_config(to_dict()) gives an equal Config.

        world_size is not in it (it is not a config key: the launcher decides it), but it is in fingerprint().
        """
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        del out["world_size"], out["source"]
        out["optimizer"] = {"type": out["optimizer"].pop("type"), "params": out["optimizer"]}
        del out["zero_optimization"]["offload_param"]["ratio"]
        if self.scheduler.type is None:
            del out["scheduler"]
        if not out["dataloader_drop_last"]:
            del out["dataloader_drop_last"]  # its default: a config without it means the same
        if not out["activation_checkpointing"].pop("enabled"):
            del out["activation_checkpointing"]  # the section being present is what enables it
        return out

    def fingerprint(self) -> str:
        """sha256 of the canonical config and the world size: ranks compare it before training together."""
        payload = json.dumps({**self.to_dict(), "world_size": self.world_size}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()


def _plain(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
