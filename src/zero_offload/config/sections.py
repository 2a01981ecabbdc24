"""The DeepSpeed sections: fp16, optimizer, scheduler, zero_optimization (with its offload sections) and
activation_checkpointing.

Each reader calls done() before its cross-checks, so a typo is reported as a typo and not as the impossible
combination that its default value happens to make.
"""

from __future__ import annotations

from .reader import AT_LEAST_1, NON_NEGATIVE, POSITIVE, SIZE, Section, convert
from .schema import (
    ActivationCheckpointingConfig,
    ConfigError,
    FP16Config,
    FrozenDict,
    LeafModuleConfig,
    OffloadConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)

_IGNORED_ZERO = (
    # The engine's gradients always go through contiguous staging buffers: DeepSpeed's switch for that is moot.
    "contiguous_gradients",
    # DeepSpeed's all-gather bucket at stages 1-2: the engine gathers one unit at a time. Stage 3's prefetch has a
    # key of its own, stage3_prefetch_bucket_size, which it honours.
    "allgather_bucket_size",
    "reduce_scatter",
    "allgather_partitions",
    "round_robin_gradients",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "ignore_unused_parameters",
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
# The key people reach for at stage 3: its warning names the one that works there.
_IGNORED_ZERO_HINTS = {"allgather_bucket_size": "stage 3 prefetches stage3_prefetch_bucket_size"}
# The engine recomputes every block; these tune how DeepSpeed's own checkpointing lays out or reports it.
_IGNORED_CHECKPOINTING = (
    "contiguous_memory_optimization",
    "number_checkpoints",
    "synchronize_checkpoint_boundary",
    "profile",
)
_STAGES = (
    "0: nothing is sharded (plain data parallelism); 1: optimizer states are sharded; "
    "2: optimizer states and gradients; 3: optimizer states, gradients and parameters"
)


def read_fp16(s: Section) -> FP16Config:
    s.refuse("auto_cast", "zero_offload does not autocast the forward pass; set it to false")
    s.refuse(
        "fp16_master_weights_and_grads",
        "zero_offload always keeps fp32 master weights (they are what it offloads); set it to false",
    )
    out = FP16Config(
        enabled=s.get("enabled", bool, False),
        loss_scale=s.get("loss_scale", float, 0.0, **NON_NEGATIVE),
        initial_scale_power=s.get(
            "initial_scale_power", int, 16, check=lambda v: 0 <= v < 64, need="an integer in [0, 64)"
        ),
        loss_scale_window=s.get("loss_scale_window", int, 1000, **AT_LEAST_1),
        hysteresis=s.get("hysteresis", int, 2, **AT_LEAST_1),
        consecutive_hysteresis=s.get("consecutive_hysteresis", bool, False),
        min_loss_scale=s.get("min_loss_scale", float, 1.0, **POSITIVE),
    )
    s.done()
    return out


def read_optimizer(s: Section) -> OptimizerConfig:
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
    betas = tuple(convert(f"{p.key('betas')}[{i}]", b, float) for i, b in enumerate(betas))
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ConfigError(
            p.key("betas"),
            f"{p.key('betas')} must be two numbers [beta1, beta2] in [0, 1), got {list(betas)}",
        )
    out = OptimizerConfig(
        type=kind,
        lr=p.get("lr", float, 1e-3, **POSITIVE),
        betas=betas,
        eps=p.get("eps", float, 1e-8, **POSITIVE),
        weight_decay=p.get("weight_decay", float, 0.0, **NON_NEGATIVE),
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
# Each scheduler's parameter names and defaults as DeepSpeed's schedulers have them; None: required.
# The schedules themselves (implementation/schedulers.py) fill in the same defaults from this table.
SCHEDULER_DEFAULTS = {
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
    "warmup_min_lr": (float, NON_NEGATIVE),
    "warmup_max_lr": (float, POSITIVE),
    "warmup_num_steps": (int, POSITIVE),
    "total_num_steps": (int, POSITIVE),
    "warmup_min_ratio": (float, _RATIO),
    "cos_min_ratio": (float, _RATIO),
    "last_batch_iteration": (int, dict(check=lambda v: v >= -1, need=">= -1 (-1 starts from the beginning)")),
}


def read_scheduler(s: Section) -> SchedulerConfig:
    # Defaults are DeepSpeed's constructor defaults: WarmupLR warms up to 1e-3, not to the optimizer's lr.
    kind = s.choice("type", tuple(SCHEDULER_DEFAULTS))
    p = s.section("params")
    s.done()
    params = {}
    for name, default in SCHEDULER_DEFAULTS[kind].items():
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


def _offload(s: Section, is_param: bool) -> OffloadConfig:
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
        buffer_count=s.get("buffer_count", int, 4, **AT_LEAST_1),
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


def _leaf_module(s: Section) -> LeafModuleConfig:
    def names(key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        value = s.get(key, list, list(default))
        if not all(isinstance(v, str) and v for v in value):
            raise ConfigError(s.key(key), f"{s.key(key)} must be a list of non-empty strings, got {value!r}")
        return tuple(value)

    out = LeafModuleConfig(
        classes=names("classes", LeafModuleConfig.classes),
        names=names("names", ()),
        name_suffixes=names("name_suffixes", ()),
    )
    s.done()
    return out


def read_zero(s: Section) -> ZeroConfig:
    s.refuse(
        "cpu_offload",
        'this legacy key is gone; write "offload_optimizer": {"device": "cpu"} '
        "inside zero_optimization instead",
    )
    s.ignore(*_IGNORED_ZERO, hints=_IGNORED_ZERO_HINTS)
    out = ZeroConfig(
        stage=s.get("stage", int, 0, check=lambda v: v in (0, 1, 2, 3), need=f"0, 1, 2 or 3 ({_STAGES})"),
        offload_optimizer=_offload(s.section("offload_optimizer"), is_param=False),
        offload_param=_offload(s.section("offload_param"), is_param=True),
        overlap_comm=s.get("overlap_comm", bool, False),
        reduce_bucket_size=s.get("reduce_bucket_size", SIZE, 500_000_000, **POSITIVE),
        stage3_prefetch_bucket_size=s.get("stage3_prefetch_bucket_size", SIZE, 50_000_000, **POSITIVE),
        sub_group_size=s.get("sub_group_size", SIZE, 1_000_000_000, **POSITIVE),
        leaf_module=_leaf_module(s.section("leaf_module")),
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
                "stage 2; DeepSpeed (at v0.19.5-27, edaa722) accepts it and silently ignores offload_param below stage 3, zero_offload "
                "rejects it."
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


def read_activation_checkpointing(s: Section) -> ActivationCheckpointingConfig:
    # Refused rather than ignored: a lesson that measures activation memory must not be misled.
    for name in ("partition_activations", "cpu_checkpointing"):
        s.refuse(
            name,
            "not supported by zero_offload (it recomputes activations but does not partition "
            "or offload them); set it to false",
        )
    s.ignore(*_IGNORED_CHECKPOINTING)
    s.done()
    return ActivationCheckpointingConfig(enabled=True)
