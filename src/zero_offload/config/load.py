"""load_config: a dict or a JSON file in, a validated Config out (or a ConfigError that names the key).

Here the top level is read: batch sizes, precision, clipping, the sections (sections.py, extension.py) and the
DeepSpeed keys that have no effect here, which are collected from every section into one warning per load.
"""

from __future__ import annotations

import json
import os
import warnings

from .extension import read_extension
from .reader import NON_NEGATIVE, POSITIVE, Section, reject_auto
from .schema import (
    ActivationCheckpointingConfig,
    BF16Config,
    Config,
    ConfigError,
    OptimizerConfig,
    SchedulerConfig,
)
from .sections import read_activation_checkpointing, read_fp16, read_optimizer, read_scheduler, read_zero

_IGNORED_TOP = (
    "steps_per_print",  # the engine keeps a history of every step instead of printing every n-th
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
        source = read_config_file(os.fspath(source))
    return _parse(source, world_size)


def _parse(data, world_size: int) -> Config:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError("world_size", f"world_size must be an integer >= 1, got {world_size!r}")
    ignored: list[str] = []
    top = Section(data, "", ignored)
    reject_auto(data)
    batch = [
        top.get(k, int, None, **POSITIVE)
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
    fp16 = read_fp16(top.section("fp16"))
    optimizer = read_optimizer(top.section("optimizer")) if top.has("optimizer") else OptimizerConfig()
    scheduler = read_scheduler(top.section("scheduler")) if top.has("scheduler") else SchedulerConfig()
    checkpointing = ActivationCheckpointingConfig()
    if top.has("activation_checkpointing"):
        checkpointing = read_activation_checkpointing(top.section("activation_checkpointing"))
    zero, extension = read_zero(top.section("zero_optimization")), read_extension(top.section("zero_offload"))
    clipping = top.get("gradient_clipping", float, 0.0, **NON_NEGATIVE)
    drop_last = top.get("dataloader_drop_last", bool, False)
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
            f"zero_offload accepts but ignores these settings (they have no effect here): {', '.join(ignored)}",
            UserWarning,
            stacklevel=3,  # the caller of load_config
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
        dataloader_drop_last=drop_last,
        source=json.loads(json.dumps(data)),
    )


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


def read_config_file(name: str) -> dict:
    try:
        with open(name, encoding="utf-8") as f:
            data = json.load(f, object_pairs_hook=_Pairs)
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
    if not isinstance(data, dict):
        raise ConfigError(
            "",
            f"config file {name!r} must hold a JSON object {{...}} at the top level, got {type(data).__name__}",
        )
    _check_unique_keys(data, name)
    return data


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
