"""DeepSpeed-style JSON configuration -> validated, frozen dataclasses.

A DeepSpeed user's JSON works here unchanged for the subset this engine implements:

    train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps,
    gradient_clipping, fp16 (dynamic loss scaling), bf16 (alias "bfloat16"),
    optimizer (Adam / AdamW), scheduler (WarmupLR, WarmupDecayLR, WarmupCosineLR),
    zero_optimization (stage, offload_optimizer, offload_param, overlap_comm,
    reduce_bucket_size, stage3_prefetch_bucket_size, sub_group_size), activation_checkpointing.

Our own settings live under one top-level key, "zero_offload" (extension.py lists them), so a DeepSpeed config
stays a DeepSpeed config.

DeepSpeed keys that have no effect here (logging, monitors, tuning knobs of features we do not have or always
use, such as steps_per_print and contiguous_gradients) are accepted with one warning per load that lists them
all. Everything else that is unknown, mistyped or impossible raises ConfigError, whose message names the key
path, what was wrong and how to fix it: a config error found at step 0 is cheap, one found after an hour of
training is not.

The files, in the order a config goes through them:

    load.py        load_config: the file or dict, the top level, batch sizes, the one warning
    reader.py      Section: typed reads of one JSON object, unknown keys with a did-you-mean
    sections.py    the DeepSpeed sections: fp16, optimizer, scheduler, zero_optimization, activation_checkpointing
    extension.py   the "zero_offload" section and its cores
    schema.py      the frozen dataclasses a Config is made of, FrozenDict, ConfigError
    rules.py       check_supported: combinations that load but that the engine cannot run
"""

from .load import load_config
from .rules import check_supported
from .schema import (
    ActivationCheckpointingConfig,
    BF16Config,
    Config,
    ConfigError,
    CoresConfig,
    CpuAdamConfig,
    DelayedParamUpdateConfig,
    ExtensionConfig,
    FP16Config,
    FrozenDict,
    OffloadConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)
from .sections import SCHEDULER_DEFAULTS

__all__ = [
    "SCHEDULER_DEFAULTS",
    "ActivationCheckpointingConfig",
    "BF16Config",
    "Config",
    "ConfigError",
    "CoresConfig",
    "CpuAdamConfig",
    "DelayedParamUpdateConfig",
    "ExtensionConfig",
    "FP16Config",
    "FrozenDict",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "check_supported",
    "load_config",
]
