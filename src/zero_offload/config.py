"""DeepSpeed-style JSON configuration -> validated, frozen dataclasses.

A DeepSpeed user's JSON works here unchanged for the subset this engine implements:

    train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps,
    gradient_clipping, steps_per_print, fp16 (dynamic loss scaling), bf16 (alias "bfloat16"),
    optimizer (Adam / AdamW), scheduler (WarmupLR, WarmupDecayLR, WarmupCosineLR),
    zero_optimization (stage, offload_optimizer, offload_param, overlap_comm, contiguous_gradients,
    reduce_bucket_size, allgather_bucket_size, sub_group_size), activation_checkpointing.

Our own settings live under one top-level key, so a DeepSpeed config stays a DeepSpeed config:

    "zero_offload": {
        "device_memory": "512MiB",          # budget of the emulated device (int bytes or a size string)
        "cpu_adam": {"impl": "simd", "threads": 2},  # the host's Adam: "simd" (default) | "torch" | "naive"
        "overlap_offload": true,            # module 5: copies and the host's Adam overlap the device's work
        "staging_slots": 4,                 # its host staging buffers per direction (default 2: double-buffered)
        "delayed_param_update": {"enabled": true, "start_step": 10},
        "cores": {"device": [0], "host": [1]},  # pin the device's compute and the host's Adam apart
        "max_skipped_steps": 20,            # stop after this many steps in a row skipped for inf/nan
        "seed": 1234
    }

DeepSpeed keys that change nothing about the arithmetic of training (logging, monitors, tuning knobs of
features we do not have) are accepted with one warning per load that lists them all. Everything else
that is unknown, mistyped or impossible raises ConfigError, whose message names the key path, what was
wrong and how to fix it: a config error found at step 0 is cheap, one found after an hour of training is not.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from zero_offload.units import parse_bytes


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
    pin_memory: bool = False
    buffer_count: int = 4
    ratio: float = 1.0  # share of the optimizer step done on the CPU (offload_optimizer only)

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = 0
    offload_optimizer: OffloadConfig = OffloadConfig()
    offload_param: OffloadConfig = OffloadConfig()
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 500_000_000  # elements, not bytes (DeepSpeed's unit)
    allgather_bucket_size: int = 500_000_000
    sub_group_size: int = 1_000_000_000


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    enabled: bool = False  # ours: true when the JSON has an "activation_checkpointing" section
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass(frozen=True)
class CpuAdamConfig:
    # The Adam of an offloaded optimizer: the C kernel ("simd"), torch's fused Adam, or module 1's naive one.
    # Optimizer states on the device are always updated by torch's fused Adam (or the naive one, if chosen).
    impl: str = "simd"  # "simd" | "torch" | "naive"
    threads: int | None = None  # None: let the implementation choose


@dataclass(frozen=True)
class DelayedParamUpdateConfig:
    enabled: bool = False
    start_step: int = 10  # the first steps run synchronously: early updates are large and must not lag


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
    seed: int = 1234
    # Skipped steps in a row (non-finite loss or gradient norm; fp16 overflow once the scale is at its floor)
    # after which the run stops with TrainingDivergedError (divergence.py) rather than train on nothing.
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
    steps_per_print: int = 10
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


# ---------------------------------------------------------------------------------------------------
# Reading one section: pop the keys we know, with type checks, then complain about whatever is left.

_SIZE = "size"  # a count DeepSpeed users write as 5e8: an int, or a float with an integral value
_KIND_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
    _SIZE: "a whole number such as 500000000 or 5e8",
}


def _describe(value) -> str:
    shown = json.dumps(value) if isinstance(value, str) else repr(value)
    return f"{shown} ({type(value).__name__})"


def _convert(path: str, value, kind):
    # bool is an int in Python, but in a config `"stage": true` is a mistake, not stage 1.
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    accepted = {
        bool: isinstance(value, bool),
        int: number and isinstance(value, int),
        float: number,
        str: isinstance(value, str),
        list: isinstance(value, (list, tuple)),
        _SIZE: number and (isinstance(value, int) or value.is_integer()),
    }[kind]
    if accepted and number and not math.isfinite(value):
        # JSON readers accept Infinity and NaN; a learning rate or an eps of either poisons every weight.
        raise ConfigError(path, f"{path} must be a finite number, got {_describe(value)}")
    if accepted:
        return float(value) if kind is float else int(value) if kind is _SIZE else value
    hint = ""
    if isinstance(value, str) and kind is not str:
        hint = '; write the value without quotes, e.g. 2 or true rather than "2" or "true"'
    raise ConfigError(path, f"{path} must be {_KIND_NAMES[kind]}, got {_describe(value)}{hint}")


class _Section:
    def __init__(self, data, path: str, ignored: list[str]):
        if not isinstance(data, dict):
            where = f"section '{path}'" if path else "the top level of the config"
            raise ConfigError(path, f"{where} must be a JSON object {{...}}, got {_describe(data)}")
        self.data, self.path, self.ignored = dict(data), path, ignored
        self.known: set[str] = set()  # every key asked about: the candidates for a did-you-mean
        self.tolerated: set[str] = set()  # the known keys that ignore() accepts without using them

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def has(self, name: str) -> bool:
        self.known.add(name)
        return name in self.data

    def get(
        self,
        name: str,
        kind,
        default=None,
        *,
        check: Callable[[Any], bool] | None = None,
        need: str = "",
        optional: bool = False,
    ):
        """Pop `name`, check its type, then `check(value)`, whose rule `need` goes into the error."""
        if not self.has(name):
            return default
        value = self.data.pop(name)
        if value is None and optional:
            return None
        value = _convert(self.key(name), value, kind)
        if check is not None and not check(value):
            raise ConfigError(self.key(name), f"{self.key(name)} must be {need}, got {_describe(value)}")
        return value

    def choice(self, name: str, allowed: tuple[str, ...], default: str | None = None) -> str:
        """One of `allowed`, matched case-insensitively, spelled as in `allowed`; required if no default."""
        if default is None and not self.has(name):
            raise ConfigError(
                self.key(name), f"{self.key(name)} is missing; allowed values: {', '.join(allowed)}"
            )
        value = self.get(name, str, default)
        canonical = {a.lower(): a for a in allowed}.get(value.lower())
        if canonical is None:
            raise ConfigError(
                self.key(name),
                f"{self.key(name)} = {json.dumps(value)} is not supported by "
                f"zero_offload; allowed values: {', '.join(allowed)}",
            )
        return canonical

    def section(self, name: str) -> _Section:
        self.has(name)
        return _Section(self.data.pop(name, {}), self.key(name), self.ignored)

    def ignore(self, *names: str) -> None:
        """DeepSpeed keys we accept and do not use: load_config warns once about all of them."""
        self.tolerated.update(names)
        for name in names:
            if self.has(name):
                self.data.pop(name)
                self.ignored.append(self.key(name))

    def refuse(self, name: str, why: str) -> None:
        """A DeepSpeed switch for a feature we do not have: false is fine, true is an error."""
        if self.get(name, bool, False):
            raise ConfigError(self.key(name), f"{self.key(name)} = true: {why}")

    def done(self) -> None:
        """Whatever is still in the section was never asked for: an unknown key."""
        for name in self.data:
            path = self.key(str(name))
            close = difflib.get_close_matches(str(name), self.known, n=1)
            guess = f"; did you mean '{close[0]}'?" if close else ""
            where = f" in {self.path}" if self.path else ""
            raise ConfigError(
                path,
                f"unknown key '{path}'{guess} allowed keys{where}: "
                f"{', '.join(sorted(self.known - self.tolerated))}",
            )


def _find_auto(value, path: str = "") -> None:
    if value == "auto":
        raise ConfigError(
            path,
            "'auto' is filled in by the Hugging Face Trainer integration; zero_offload "
            f"needs a concrete value for {path}",
        )
    if isinstance(value, dict):
        for k, v in value.items():
            _find_auto(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _find_auto(v, f"{path}[{i}]")


# ---------------------------------------------------------------------------------------------------
# The sections. Each reader calls done() before its cross-checks, so a typo is reported as a typo
# and not as the impossible combination that its default value happens to make.

_POSITIVE = dict(check=lambda v: v > 0, need="> 0")
_NON_NEGATIVE = dict(check=lambda v: v >= 0, need=">= 0")
_AT_LEAST_1 = dict(check=lambda v: v >= 1, need=">= 1")

_IGNORED_TOP = (
    "wall_clock_breakdown",
    "zero_allow_untested_optimizer",
    "dump_state",
    "prescale_gradients",
    "gradient_predivide_factor",
    "communication_data_type",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "flops_profiler",
    "comms_logger",
    "memory_breakpoint",
    "sparse_gradients",
    "data_types",
    "checkpoint",
    "zero_force_ds_cpu_optimizer",
)
_IGNORED_ZERO = (
    "reduce_scatter",
    "allgather_partitions",
    "round_robin_gradients",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "ignore_unused_parameters",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "memory_efficient_linear",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "mics_shard_size",
    "use_multi_rank_bucket_allreduce",
    "log_trace_cache_warnings",
)
_STAGES = (
    "0: nothing is sharded (plain data parallelism); 1: optimizer states are sharded; "
    "2: optimizer states and gradients; 3: optimizer states, gradients and parameters"
)


def _fp16(s: _Section) -> FP16Config:
    s.refuse("auto_cast", "zero_offload does not autocast the forward pass; set it to false")
    s.refuse(
        "fp16_master_weights_and_grads",
        "zero_offload always keeps fp32 master weights (they are what it offloads); set it to false",
    )
    out = FP16Config(
        enabled=s.get("enabled", bool, False),
        loss_scale=s.get("loss_scale", float, 0.0, **_NON_NEGATIVE),
        initial_scale_power=s.get(
            "initial_scale_power", int, 16, check=lambda v: 0 <= v < 64, need="an integer in [0, 64)"
        ),
        loss_scale_window=s.get("loss_scale_window", int, 1000, **_AT_LEAST_1),
        hysteresis=s.get("hysteresis", int, 2, **_AT_LEAST_1),
        consecutive_hysteresis=s.get("consecutive_hysteresis", bool, False),
        min_loss_scale=s.get("min_loss_scale", float, 1.0, **_POSITIVE),
    )
    s.done()
    return out


def _optimizer(s: _Section) -> OptimizerConfig:
    kind = s.choice("type", ("Adam", "AdamW"))
    s.ignore("legacy_fusion")
    p = s.section("params")
    s.done()
    if p.has("max_grad_norm"):
        raise ConfigError(
            p.key("max_grad_norm"),
            f"{p.key('max_grad_norm')}: clipping is not an optimizer "
            'parameter; use the top-level "gradient_clipping" instead',
        )
    p.refuse("amsgrad", "AMSGrad is not supported by zero_offload's Adam; remove it")
    p.ignore("torch_adam", "fused")
    betas = p.get("betas", list, [0.9, 0.999])
    betas = tuple(_convert(f"{p.key('betas')}[{i}]", b, float) for i, b in enumerate(betas))
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ConfigError(
            p.key("betas"),
            f"{p.key('betas')} must be two numbers [beta1, beta2] in [0, 1), got {list(betas)}",
        )
    out = OptimizerConfig(
        type=kind,
        lr=p.get("lr", float, 1e-3, **_POSITIVE),
        betas=betas,
        eps=p.get("eps", float, 1e-8, **_POSITIVE),
        weight_decay=p.get("weight_decay", float, 0.0, **_NON_NEGATIVE),
        # DeepSpeed's "Adam" decays weights the decoupled (AdamW) way unless told otherwise.
        adam_w_mode=p.get("adam_w_mode", bool, True),
        bias_correction=p.get("bias_correction", bool, True),
    )
    p.done()
    if kind == "AdamW" and not out.adam_w_mode:
        raise ConfigError(
            p.key("adam_w_mode"),
            f'{p.key("adam_w_mode")} = false contradicts type "AdamW"; '
            'for L2-style decay write "type": "Adam" with adam_w_mode false',
        )
    return out


_REQUIRED = None
_WARMUP = {
    "warmup_min_lr": 0.0,
    "warmup_max_lr": 1e-3,
    "warmup_num_steps": 1000,
    "warmup_type": "log",
    "last_batch_iteration": -1,
}
_SCHEDULERS = {  # parameter names and defaults as DeepSpeed's schedulers have them
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {**_WARMUP, "total_num_steps": _REQUIRED},
    "WarmupCosineLR": {
        "total_num_steps": _REQUIRED,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 1e-4,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    },
}
_RATIO = dict(check=lambda v: 0 <= v <= 1, need="in [0, 1]")
_SCHEDULER_RULES = {
    "warmup_min_lr": (float, _NON_NEGATIVE),
    "warmup_max_lr": (float, _POSITIVE),
    "warmup_num_steps": (int, _POSITIVE),
    "total_num_steps": (int, _POSITIVE),
    "warmup_min_ratio": (float, _RATIO),
    "cos_min_ratio": (float, _RATIO),
    "last_batch_iteration": (int, dict(check=lambda v: v >= -1, need=">= -1 (-1 starts from the beginning)")),
}


def _scheduler(s: _Section) -> SchedulerConfig:
    # Defaults are DeepSpeed's constructor defaults: WarmupLR warms up to 1e-3, not to the optimizer's lr.
    kind = s.choice("type", tuple(_SCHEDULERS))
    p = s.section("params")
    s.done()
    params = {}
    for name, default in _SCHEDULERS[kind].items():
        if name == "warmup_type":
            params[name] = p.choice(name, ("log", "linear"), default)
            continue
        if default is _REQUIRED and not p.has(name):
            raise ConfigError(
                p.key(name),
                f"{p.key(name)} is required by {kind}: the decay must know when "
                "training ends; set it to the total number of optimizer steps",
            )
        kind_, rule = _SCHEDULER_RULES[name]
        params[name] = p.get(name, kind_, default, **rule)
    p.done()
    if "warmup_max_lr" in params and params["warmup_min_lr"] > params["warmup_max_lr"]:
        raise ConfigError(
            p.key("warmup_min_lr"),
            f"{p.key('warmup_min_lr')} {params['warmup_min_lr']} is above {p.key('warmup_max_lr')} "
            f"{params['warmup_max_lr']} (1e-3 when not set): the warm-up would lower the learning "
            "rate; make warmup_min_lr the smaller one",
        )
    return SchedulerConfig(type=kind, params=FrozenDict(params))


def _offload(s: _Section, is_param: bool) -> OffloadConfig:
    if is_param and s.has("ratio"):
        raise ConfigError(
            s.key("ratio"),
            f"{s.key('ratio')}: ratio splits the optimizer step between CPU and "
            "GPU, so it belongs in offload_optimizer; remove it here",
        )
    s.ignore("fast_init", "buffer_size", "max_in_cpu", "pipeline_read", "pipeline_write")
    out = OffloadConfig(
        device=s.choice("device", ("none", "cpu", "nvme"), "none"),
        nvme_path=s.get("nvme_path", str, None, optional=True),
        pin_memory=s.get("pin_memory", bool, False),
        buffer_count=s.get("buffer_count", int, 4, **_AT_LEAST_1),
        ratio=s.get("ratio", float, 1.0, check=lambda v: 0 < v <= 1, need="in (0, 1]"),
    )
    s.done()
    if out.device == "nvme" and not out.nvme_path:
        raise ConfigError(
            s.key("nvme_path"),
            f'{s.key("device")} is "nvme" but {s.key("nvme_path")} is not '
            "set; give a directory on the NVMe drive for the swap files",
        )
    return out


def _zero(s: _Section) -> ZeroConfig:
    s.refuse(
        "cpu_offload",
        'this legacy key is gone; write "offload_optimizer": {"device": "cpu"} '
        "inside zero_optimization instead",
    )
    s.ignore(*_IGNORED_ZERO)
    out = ZeroConfig(
        stage=s.get("stage", int, 0, check=lambda v: v in (0, 1, 2, 3), need=f"0, 1, 2 or 3 ({_STAGES})"),
        offload_optimizer=_offload(s.section("offload_optimizer"), is_param=False),
        offload_param=_offload(s.section("offload_param"), is_param=True),
        overlap_comm=s.get("overlap_comm", bool, False),
        contiguous_gradients=s.get("contiguous_gradients", bool, True),
        reduce_bucket_size=s.get("reduce_bucket_size", _SIZE, 500_000_000, **_POSITIVE),
        allgather_bucket_size=s.get("allgather_bucket_size", _SIZE, 500_000_000, **_POSITIVE),
        sub_group_size=s.get("sub_group_size", _SIZE, 1_000_000_000, **_POSITIVE),
    )
    s.done()
    if out.offload_param.enabled and out.stage != 3:
        path = s.key("offload_param.device")
        raise ConfigError(
            path,
            (
                f'{path} is "{out.offload_param.device}" but zero_optimization.stage is {out.stage}; parameter '
                "offload needs stage 3. At stages 1 and 2 every GPU keeps the full fp16 parameters (they are not "
                "partitioned), so there is no parameter shard to offload: parameter offload is a ZeRO-3 feature "
                '(ZeRO-Infinity). Fix: set "stage": 3, or drop offload_param and keep offload_optimizer with '
                "stage 2 (ZeRO-Offload). The course introduction's example config pairs offload_param with "
                "stage 2; DeepSpeed ignores or rejects that combination, and zero_offload rejects it."
            ),
        )
    if out.offload_optimizer.enabled and out.stage == 0:
        path = s.key("offload_optimizer.device")
        raise ConfigError(
            path,
            f"{path} needs zero_optimization.stage >= 1, got stage 0; use stage 2 (on one "
            "GPU stage 2 shards nothing and offloads everything, as ZeRO-Offload does)",
        )
    return out


def _activation_checkpointing(s: _Section) -> ActivationCheckpointingConfig:
    # Refused rather than ignored: a lesson that measures activation memory must not be misled.
    for name in ("partition_activations", "cpu_checkpointing"):
        s.refuse(
            name,
            "not supported by zero_offload (it recomputes activations but does not partition "
            "or offload them); set it to false",
        )
    out = ActivationCheckpointingConfig(
        enabled=True,
        contiguous_memory_optimization=s.get("contiguous_memory_optimization", bool, False),
        number_checkpoints=s.get("number_checkpoints", int, None, optional=True, **_AT_LEAST_1),
        synchronize_checkpoint_boundary=s.get("synchronize_checkpoint_boundary", bool, False),
        profile=s.get("profile", bool, False),
    )
    s.done()
    return out


def _extension(s: _Section) -> ExtensionConfig:
    device_memory = s.data.pop("device_memory", None) if s.has("device_memory") else None
    if device_memory is not None:
        try:
            device_memory = parse_bytes(device_memory)
        except ValueError as err:
            raise ConfigError(s.key("device_memory"), f"{s.key('device_memory')}: {err}") from None
        if device_memory <= 0:
            raise ConfigError(s.key("device_memory"), f"{s.key('device_memory')} must be more than 0 bytes")
    adam, delayed = s.section("cpu_adam"), s.section("delayed_param_update")
    out = ExtensionConfig(
        device_memory=device_memory,
        seed=s.get("seed", int, 1234, **_NON_NEGATIVE),
        cpu_adam=CpuAdamConfig(
            impl=adam.choice("impl", ("simd", "torch", "naive"), "simd"),
            threads=adam.get("threads", int, None, optional=True, **_AT_LEAST_1),
        ),
        overlap_offload=s.get("overlap_offload", bool, False),
        staging_slots=s.get("staging_slots", int, 2, **_AT_LEAST_1),
        max_skipped_steps=s.get("max_skipped_steps", int, 20, **_AT_LEAST_1),
        delayed_param_update=DelayedParamUpdateConfig(
            enabled=delayed.get("enabled", bool, False),
            start_step=delayed.get("start_step", int, 10, **_NON_NEGATIVE),
        ),
        cores=_cores(s.section("cores")),
    )
    for section in (adam, delayed, s):
        section.done()
    return out


def _cores(s: _Section) -> CoresConfig:
    # All of the machine's cores, not this thread's affinity: an engine made earlier may have pinned this thread.
    usable = list(range(os.cpu_count() or 1)) if hasattr(os, "sched_setaffinity") else []
    picked = {}
    for side in ("device", "host"):
        cores = s.get(side, list, [])
        if cores and not usable:
            raise ConfigError(
                s.key(side), f"{s.key(side)}: this system cannot pin threads to cores; remove it"
            )
        bad = [c for c in cores if not isinstance(c, int) or isinstance(c, bool) or c not in usable]
        if bad:
            raise ConfigError(
                s.key(side),
                f"{s.key(side)} = {json.dumps(cores)}: {json.dumps(bad)} not among this machine's cores "
                f"(0 to {len(usable) - 1})",
            )
        picked[side] = tuple(cores)
    s.done()
    shared = set(picked["device"]) & set(picked["host"])
    if shared:
        raise ConfigError(
            s.key("host"),
            f"{s.key('device')} and {s.key('host')} share core(s) {sorted(shared)}; give each side its own "
            "cores, or leave both lists out to let them share all cores",
        )
    return CoresConfig(**picked)


def _batch_sizes(
    tbs: int | None, micro: int | None, gas: int | None, world_size: int
) -> tuple[int, int, int]:
    """DeepSpeed's rule: train_batch_size = micro batch per GPU x accumulation steps x world size."""
    ws = f"world size {world_size}"
    if tbs is None and micro is None:
        raise ConfigError(
            "train_batch_size",
            "set train_batch_size (the global batch) or "
            "train_micro_batch_size_per_gpu (the batch of one forward pass)",
        )
    if micro is None:
        gas = gas or 1
        if tbs % (gas * world_size):
            raise ConfigError(
                "train_batch_size",
                (
                    f"train_batch_size {tbs} is a global batch the {ws} cannot divide: {tbs} / (gradient_"
                    f"accumulation_steps {gas} x {ws}) is not whole; choose a multiple of {gas * world_size}"
                ),
            )
        micro = tbs // (gas * world_size)
    elif tbs is None:
        gas = gas or 1
        tbs = micro * gas * world_size
    elif gas is None:
        if tbs % (micro * world_size):
            raise ConfigError(
                "train_batch_size",
                (
                    f"train_batch_size {tbs} is not divisible by train_micro_batch_size_per_gpu {micro} x {ws} = "
                    f"{micro * world_size}; choose a multiple of {micro * world_size} or another micro batch"
                ),
            )
        gas = tbs // (micro * world_size)
    if tbs != micro * gas * world_size:
        raise ConfigError(
            "train_batch_size",
            (
                f"train_batch_size {tbs} != train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps "
                f"{gas} x {ws} = {micro * gas * world_size}; fix one of them, or leave one out to have it derived"
            ),
        )
    return tbs, micro, gas


def _parse(data, world_size: int) -> Config:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError("world_size", f"world_size must be an integer >= 1, got {world_size!r}")
    ignored: list[str] = []
    top = _Section(data, "", ignored)
    _find_auto(data)
    batch = [
        top.get(k, int, None, **_POSITIVE)
        for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    ]
    if top.has("bf16") and top.has("bfloat16"):
        raise ConfigError("bfloat16", "both 'bf16' and its alias 'bfloat16' are present; keep only 'bf16'")
    bf16 = top.section("bfloat16" if "bfloat16" in top.data else "bf16")
    bf16.ignore("immediate_grad_update")
    bf16_config = BF16Config(enabled=bf16.get("enabled", bool, False))
    bf16.done()
    if top.has("amp"):
        top.section("amp").refuse("enabled", 'NVIDIA Apex AMP is not supported; use "fp16" or "bf16"')
        ignored.append("amp")  # its other keys are Apex options, meaningless while amp is off
    fp16 = _fp16(top.section("fp16"))
    optimizer = _optimizer(top.section("optimizer")) if top.has("optimizer") else OptimizerConfig()
    scheduler = _scheduler(top.section("scheduler")) if top.has("scheduler") else SchedulerConfig()
    checkpointing = ActivationCheckpointingConfig()
    if top.has("activation_checkpointing"):
        checkpointing = _activation_checkpointing(top.section("activation_checkpointing"))
    zero, extension = _zero(top.section("zero_optimization")), _extension(top.section("zero_offload"))
    clipping = top.get("gradient_clipping", float, 0.0, **_NON_NEGATIVE)
    steps_per_print = top.get("steps_per_print", int, 10, **_POSITIVE)
    top.ignore(*_IGNORED_TOP)
    top.done()
    if fp16.enabled and bf16_config.enabled:
        raise ConfigError(
            f"{bf16.path}.enabled",
            f"fp16.enabled and {bf16.path}.enabled are both true; choose "
            "one: bf16 where the GPU supports it (no loss scaling), else fp16",
        )
    tbs, micro, gas = _batch_sizes(*batch, world_size)
    if ignored:
        warnings.warn(
            f"zero_offload accepts but ignores these DeepSpeed settings: {', '.join(ignored)}",
            UserWarning,
            stacklevel=3,
        )
    return Config(
        train_batch_size=tbs,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=gas,
        world_size=world_size,
        gradient_clipping=clipping,
        fp16=fp16,
        bf16=bf16_config,
        optimizer=optimizer,
        scheduler=scheduler,
        zero_optimization=zero,
        activation_checkpointing=checkpointing,
        zero_offload=extension,
        steps_per_print=steps_per_print,
        source=json.loads(json.dumps(data)),
    )


def load_config(source: dict | str | os.PathLike | Config, *, world_size: int = 1) -> Config:
    """Read and validate a config: a dict, a path to a JSON file, or a Config (re-derived for world_size)."""
    if isinstance(source, Config):
        if source.world_size == world_size:
            return source
        if source.source is not None:
            return _parse(source.source, world_size)
        # Built in Python, not from JSON: keep the per-GPU batch and derive the global one afresh.
        return _parse({k: v for k, v in source.to_dict().items() if k != "train_batch_size"}, world_size)
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        try:
            with open(name, encoding="utf-8") as f:
                source = json.load(f, object_pairs_hook=_Pairs)
        except OSError as err:
            raise ConfigError("", f"cannot read config file {name!r}: {err.strerror}") from None
        except UnicodeDecodeError as err:
            raise ConfigError(
                "",
                f"config file {name!r} is not UTF-8 text ({err.reason}); save it as UTF-8, as JSON requires",
            ) from None
        except json.JSONDecodeError as err:
            raise ConfigError(
                "",
                f"config file {name!r} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}",
            ) from None
        except ValueError as err:  # a NUL in the name; a number of more than 4300 digits in the file
            raise ConfigError(
                "", f"cannot read config file {name!r}: {err}; check the name and the file"
            ) from None
        if not isinstance(source, dict):
            raise ConfigError(
                "",
                f"config file {name!r} must hold a JSON object {{...}} at the top level, "
                f"got {type(source).__name__}",
            )
        _check_unique_keys(source, name)
    return _parse(source, world_size)


class _Pairs(dict):
    """A JSON object that remembers the keys it held twice: json.load would keep the last one silently."""

    def __init__(self, pairs):
        super().__init__(pairs)
        keys = [key for key, _ in pairs]
        self.repeated = [key for key in self if keys.count(key) > 1] if len(self) < len(keys) else []


def _check_unique_keys(value, name: str, path: str = "") -> None:
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_unique_keys(item, name, f"{path}[{i}]")
    if not isinstance(value, dict):
        return
    if getattr(value, "repeated", None):
        where = f"{path}.{value.repeated[0]}" if path else value.repeated[0]
        raise ConfigError(
            where,
            f"{where} appears more than once in config file {name!r}; JSON readers keep only the last one "
            "(so one of the two values is ignored): keep one",
        )
    for key, item in value.items():
        _check_unique_keys(item, name, f"{path}.{key}" if path else key)
