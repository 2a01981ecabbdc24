"""DeepSpeed-style configs: what loads, what is derived, and what each mistake says."""

from __future__ import annotations

import copy
import json
import math
import pickle
import warnings

import pytest

from zero_offload.config import (
    Config,
    ConfigError,
    FP16Config,
    OffloadConfig,
    OptimizerConfig,
    ZeroConfig,
    load_config,
)

# The example from the course introduction, verbatim: it pairs offload_param with stage 2.
COURSE_INTRO = {
    "train_batch_size": 64,
    "fp16": {"enabled": True},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
    },
}

# A typical DeepSpeed ZeRO-2 offload config, as DeepSpeed users write it (sizes as 5e8 floats).
ZERO2_OFFLOAD = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 500,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_num_steps": 100, "total_num_steps": 1000, "warmup_max_lr": 3e-4},
    },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 2e8,
    },
}


def with_(base: dict, path: str, value) -> dict:
    """A deep copy of `base` with the key at dotted `path` set to `value`."""
    out = copy.deepcopy(base)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return out


def without(base: dict, path: str) -> dict:
    out = copy.deepcopy(base)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[key]
    del node[last]
    return out


BASE = {"train_batch_size": 8}
# The introduction's config made runnable: no offload_param, and no key that would only draw a warning.
STAGE2 = without(
    without(COURSE_INTRO, "zero_optimization.offload_param"), "zero_optimization.contiguous_gradients"
)

# (id, config, world_size, key path in the error, fragment of the fix/explanation)
BAD = [
    (
        "typo",
        with_(STAGE2, "zero_optimization.stagee", 2),
        1,
        "zero_optimization.stagee",
        "did you mean 'stage'",
    ),
    (
        "typo-top",
        with_(BASE, "gradient_cliping", 1.0),
        1,
        "gradient_cliping",
        "did you mean 'gradient_clipping'",
    ),
    (
        "typo-offload",
        with_(STAGE2, "zero_optimization.offload_optimizer.pin_memroy", True),
        1,
        "zero_optimization.offload_optimizer.pin_memroy",
        "did you mean 'pin_memory'",
    ),
    (
        "stage-5",
        with_(BASE, "zero_optimization.stage", 5),
        1,
        "zero_optimization.stage",
        "gradients and parameters",
    ),
    ("course-intro", COURSE_INTRO, 1, "zero_optimization.offload_param.device", "stage 3"),
    ("course-intro-why", COURSE_INTRO, 1, "zero_optimization.offload_param.device", "not partitioned"),
    (
        "fp16-and-bf16",
        {**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
        1,
        "bf16.enabled",
        "choose one",
    ),
    (
        "fp16-and-bfloat16",
        {**BASE, "fp16": {"enabled": True}, "bfloat16": {"enabled": True}},
        1,
        "bfloat16.enabled",
        "choose one",
    ),
    (
        "bf16-twice",
        {**BASE, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}},
        1,
        "bfloat16",
        "keep only",
    ),
    (
        "batch-mismatch",
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2},
        2,
        "train_batch_size",
        "8 x gradient_accumulation_steps 2",
    ),
    ("batch-not-divisible", {"train_batch_size": 10}, 4, "train_batch_size", "world size 4 cannot divide"),
    (
        "batch-micro-not-divisible",
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 6},
        2,
        "train_batch_size",
        "choose a multiple of 12",
    ),
    (
        "batch-missing",
        {"gradient_accumulation_steps": 4},
        1,
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
    ),
    ("batch-zero", {"train_batch_size": 0}, 1, "train_batch_size", "> 0"),
    (
        "stage-string",
        with_(BASE, "zero_optimization.stage", "2"),
        1,
        "zero_optimization.stage",
        "without quotes",
    ),
    ("stage-bool", with_(BASE, "zero_optimization.stage", True), 1, "zero_optimization.stage", "an integer"),
    (
        "fp16-power-float",
        with_(BASE, "fp16.initial_scale_power", 16.5),
        1,
        "fp16.initial_scale_power",
        "an integer",
    ),
    ("fp16-list", with_(BASE, "fp16", [True]), 1, "fp16", "JSON object"),
    ("enabled-string", with_(BASE, "fp16.enabled", "true"), 1, "fp16.enabled", "true or false"),
    (
        "lr-string",
        with_(BASE, "optimizer", {"type": "AdamW", "params": {"lr": "1e-3"}}),
        1,
        "optimizer.params.lr",
        "without quotes",
    ),
    ("auto", {"train_batch_size": "auto"}, 1, "train_batch_size", "Hugging Face Trainer"),
    (
        "auto-nested",
        with_(BASE, "optimizer", {"type": "AdamW", "params": {"lr": "auto"}}),
        1,
        "optimizer.params.lr",
        "needs a concrete value",
    ),
    (
        "nvme-no-path",
        with_(STAGE2, "zero_optimization.offload_optimizer.device", "nvme"),
        1,
        "zero_optimization.offload_optimizer.nvme_path",
        "directory",
    ),
    (
        "bad-device",
        with_(STAGE2, "zero_optimization.offload_optimizer.device", "gpu"),
        1,
        "zero_optimization.offload_optimizer.device",
        "none, cpu, nvme",
    ),
    (
        "offload-stage0",
        with_(STAGE2, "zero_optimization.stage", 0),
        1,
        "zero_optimization.offload_optimizer.device",
        "use stage 2",
    ),
    (
        "param-ratio",
        with_(BASE, "zero_optimization", {"stage": 3, "offload_param": {"device": "cpu", "ratio": 0.5}}),
        1,
        "zero_optimization.offload_param.ratio",
        "offload_optimizer",
    ),
    (
        "ratio-range",
        with_(STAGE2, "zero_optimization.offload_optimizer.ratio", 1.5),
        1,
        "zero_optimization.offload_optimizer.ratio",
        "(0, 1]",
    ),
    ("optimizer-type", with_(BASE, "optimizer", {"type": "Lamb"}), 1, "optimizer.type", "Adam, AdamW"),
    ("optimizer-no-type", with_(BASE, "optimizer", {"params": {"lr": 1e-3}}), 1, "optimizer.type", "missing"),
    (
        "adamw-not-w",
        with_(BASE, "optimizer", {"type": "AdamW", "params": {"adam_w_mode": False}}),
        1,
        "optimizer.params.adam_w_mode",
        '"Adam"',
    ),
    (
        "amsgrad",
        with_(BASE, "optimizer", {"type": "Adam", "params": {"amsgrad": True}}),
        1,
        "optimizer.params.amsgrad",
        "not supported",
    ),
    (
        "max-grad-norm",
        with_(BASE, "optimizer", {"type": "Adam", "params": {"max_grad_norm": 1.0}}),
        1,
        "optimizer.params.max_grad_norm",
        "gradient_clipping",
    ),
    (
        "betas-three",
        with_(BASE, "optimizer", {"type": "Adam", "params": {"betas": [0.9, 0.99, 0.9]}}),
        1,
        "optimizer.params.betas",
        "two numbers",
    ),
    (
        "betas-range",
        with_(BASE, "optimizer", {"type": "Adam", "params": {"betas": [0.9, 1.0]}}),
        1,
        "optimizer.params.betas",
        "[0, 1)",
    ),
    (
        "lr-negative",
        with_(BASE, "optimizer", {"type": "Adam", "params": {"lr": -1}}),
        1,
        "optimizer.params.lr",
        "> 0",
    ),
    (
        "cpu-offload-legacy",
        with_(BASE, "zero_optimization", {"stage": 2, "cpu_offload": True}),
        1,
        "zero_optimization.cpu_offload",
        "offload_optimizer",
    ),
    (
        "device-memory",
        with_(BASE, "zero_offload.device_memory", "12 parsecs"),
        1,
        "zero_offload.device_memory",
        "512MiB",
    ),
    (
        "device-memory-bool",
        with_(BASE, "zero_offload.device_memory", True),
        1,
        "zero_offload.device_memory",
        "byte size",
    ),
    (
        "cpu-adam-impl",
        with_(BASE, "zero_offload.cpu_adam.impl", "avx512"),
        1,
        "zero_offload.cpu_adam.impl",
        "simd, torch, naive",
    ),
    (
        "threads-zero",
        with_(BASE, "zero_offload.cpu_adam.threads", 0),
        1,
        "zero_offload.cpu_adam.threads",
        ">= 1",
    ),
    ("fp16-power", with_(BASE, "fp16.initial_scale_power", 64), 1, "fp16.initial_scale_power", "[0, 64)"),
    ("fp16-window", with_(BASE, "fp16.loss_scale_window", 0), 1, "fp16.loss_scale_window", ">= 1"),
    ("fp16-min-scale", with_(BASE, "fp16.min_loss_scale", 0), 1, "fp16.min_loss_scale", "> 0"),
    ("fp16-auto-cast", with_(BASE, "fp16.auto_cast", True), 1, "fp16.auto_cast", "set it to false"),
    (
        "fp16-master",
        with_(BASE, "fp16.fp16_master_weights_and_grads", True),
        1,
        "fp16.fp16_master_weights_and_grads",
        "fp32 master weights",
    ),
    ("amp", with_(BASE, "amp", {"enabled": True, "opt_level": "O1"}), 1, "amp.enabled", '"fp16"'),
    ("clipping", with_(BASE, "gradient_clipping", -1.0), 1, "gradient_clipping", ">= 0"),
    (
        "bucket-fraction",
        with_(BASE, "zero_optimization.reduce_bucket_size", 1.5),
        1,
        "zero_optimization.reduce_bucket_size",
        "whole number",
    ),
    (
        "bucket-zero",
        with_(BASE, "zero_optimization.reduce_bucket_size", 0),
        1,
        "zero_optimization.reduce_bucket_size",
        "> 0",
    ),
    (
        "scheduler-type",
        with_(BASE, "scheduler", {"type": "OneCycle", "params": {}}),
        1,
        "scheduler.type",
        "WarmupLR",
    ),
    (
        "scheduler-total",
        with_(BASE, "scheduler", {"type": "WarmupCosineLR", "params": {}}),
        1,
        "scheduler.params.total_num_steps",
        "total number of optimizer steps",
    ),
    (
        "scheduler-param",
        with_(BASE, "scheduler", {"type": "WarmupLR", "params": {"cos_min_ratio": 0.1}}),
        1,
        "scheduler.params.cos_min_ratio",
        "allowed keys",
    ),
    (
        "scheduler-warmup-type",
        with_(BASE, "scheduler", {"type": "WarmupLR", "params": {"warmup_type": "exp"}}),
        1,
        "scheduler.params.warmup_type",
        "log, linear",
    ),
    (
        "ckpt-partition",
        with_(BASE, "activation_checkpointing", {"partition_activations": True}),
        1,
        "activation_checkpointing.partition_activations",
        "not supported by zero_offload",
    ),
    (
        "ckpt-cpu",
        with_(BASE, "activation_checkpointing", {"cpu_checkpointing": True}),
        1,
        "activation_checkpointing.cpu_checkpointing",
        "not supported by zero_offload",
    ),
    (
        "delayed-start",
        with_(BASE, "zero_offload.delayed_param_update.start_step", -1),
        1,
        "zero_offload.delayed_param_update.start_step",
        ">= 0",
    ),
    *[
        (
            f"max-skipped-{value!r}",
            with_(BASE, "zero_offload.max_skipped_steps", value),
            1,
            "zero_offload.max_skipped_steps",
            fix,
        )
        for value, fix in ((0, ">= 1"), (-3, ">= 1"), (2.5, "integer"), ("20", "integer"), (True, "integer"))
    ],
    ("top-not-dict", [BASE], 1, "", "JSON object"),
    ("world-size", BASE, 0, "world_size", ">= 1"),
]


@pytest.mark.parametrize("config, world_size, path, fix", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_names_the_key_and_the_fix(config, world_size, path, fix):
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size=world_size)
    message = str(info.value)
    assert info.value.path == path
    assert path in message
    assert fix in message
    assert "Traceback" not in message


def test_course_intro_error_explains_the_stage_2_pairing():
    with pytest.raises(ConfigError) as info:
        load_config(COURSE_INTRO)
    message = str(info.value)
    assert "course introduction" in message and "ZeRO-Infinity" in message
    assert "drop offload_param" in message


def test_typo_is_reported_before_the_combination_its_default_makes():
    # With "stagee" the stage defaults to 0, which forbids offload_optimizer: the typo is the real problem.
    config = with_(without(STAGE2, "zero_optimization.stage"), "zero_optimization.stagee", 2)
    with pytest.raises(ConfigError, match="did you mean 'stage'"):
        load_config(config)


def test_conversion_errors_do_not_chain_a_traceback():
    with pytest.raises(ConfigError) as info:
        load_config(with_(BASE, "zero_offload.device_memory", "lots"))
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_zero2_offload_config_loads_as_written():
    cfg = load_config(ZERO2_OFFLOAD, world_size=4)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        64,
        8,
        2,
    )
    assert cfg.world_size == 4
    assert cfg.precision == "fp16" and cfg.fp16.dynamic and cfg.fp16.initial_scale_power == 12
    assert cfg.fp16.min_loss_scale == 1.0 and isinstance(cfg.fp16.min_loss_scale, float)
    assert cfg.gradient_clipping == 1.0
    zero = cfg.zero_optimization
    assert zero.stage == 2 and zero.overlap_comm
    assert zero.offload_optimizer == OffloadConfig(device="cpu", pin_memory=True)
    assert zero.offload_optimizer.enabled and not zero.offload_param.enabled
    assert zero.reduce_bucket_size == 500_000_000 and type(zero.reduce_bucket_size) is int
    assert zero.stage3_prefetch_bucket_size == 200_000_000
    assert cfg.optimizer == OptimizerConfig(type="AdamW", lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    assert cfg.scheduler.type == "WarmupDecayLR"
    assert cfg.scheduler.params["warmup_num_steps"] == 100
    assert cfg.scheduler.params["warmup_type"] == "log"  # DeepSpeed's default, filled in
    assert cfg.scheduler.params["warmup_min_lr"] == 0.0


def test_defaults():
    cfg = load_config({"train_micro_batch_size_per_gpu": 4})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        4,
        4,
        1,
    )
    assert cfg.precision == "fp32" and cfg.fp16 == FP16Config() and not cfg.bf16.enabled
    assert cfg.optimizer == OptimizerConfig() and cfg.optimizer.adamw
    assert cfg.scheduler.type is None and dict(cfg.scheduler.params) == {}
    assert cfg.zero_optimization == ZeroConfig()
    assert not cfg.activation_checkpointing.enabled
    assert cfg.zero_offload.device_memory is None and cfg.zero_offload.cpu_adam.impl == "simd"
    assert cfg.zero_offload.delayed_param_update.start_step == 40
    assert cfg.zero_offload.max_skipped_steps == 20
    assert cfg.gradient_clipping == 0.0


@pytest.mark.parametrize(
    "given, world_size, expected",
    [
        ({"train_batch_size": 64}, 4, (64, 16, 1)),
        ({"train_micro_batch_size_per_gpu": 4}, 2, (8, 4, 1)),
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 2, (64, 4, 8)),
        ({"train_batch_size": 64, "gradient_accumulation_steps": 4}, 2, (64, 8, 4)),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 2, (12, 2, 3)),
        (
            {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
            2,
            (12, 2, 3),
        ),
    ],
)
def test_batch_sizes_are_derived(given, world_size, expected):
    cfg = load_config(given, world_size=world_size)
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == expected


def test_config_file_on_disk(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO2_OFFLOAD))
    assert load_config(path, world_size=4) == load_config(ZERO2_OFFLOAD, world_size=4)
    assert load_config(str(path), world_size=4) == load_config(ZERO2_OFFLOAD, world_size=4)


def test_bad_config_files(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "train_batch_size": 8,\n}\n')
    with pytest.raises(ConfigError, match=r"broken\.json.*line 3 column 1"):
        load_config(broken)
    with pytest.raises(ConfigError, match="missing.json"):
        load_config(tmp_path / "missing.json")
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"list\.json.*JSON object"):
        load_config(listing)


def test_harmless_deepspeed_keys_warn_once_listing_all():
    config = {
        **ZERO2_OFFLOAD,
        "wall_clock_breakdown": False,
        "tensorboard": {"enabled": False},
        "zero_allow_untested_optimizer": True,
    }
    config = with_(config, "zero_optimization.reduce_scatter", True)
    config = with_(config, "zero_optimization.offload_optimizer.fast_init", False)
    config = with_(config, "optimizer.params.torch_adam", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(config, world_size=4)
    assert len(caught) == 1 and caught[0].category is UserWarning
    message = str(caught[0].message)
    for key in (
        "wall_clock_breakdown",
        "tensorboard",
        "zero_allow_untested_optimizer",
        "zero_optimization.reduce_scatter",
        "zero_optimization.offload_optimizer.fast_init",
        "optimizer.params.torch_adam",
    ):
        assert key in message
    assert caught[0].filename == __file__  # points at the caller, not inside zero_offload.config
    with pytest.warns(UserWarning, match="wall_clock_breakdown"):
        load_config(config, world_size=4)
    assert cfg == load_config(ZERO2_OFFLOAD, world_size=4)


def test_supported_config_loads_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(ZERO2_OFFLOAD, world_size=4)


# Keys that load but change nothing here: each must say so, and must leave no field behind that looks like a knob.
CHECKPOINTING = with_(BASE, "activation_checkpointing", {})
NO_EFFECT = [
    (BASE, "steps_per_print", 100),
    (STAGE2, "zero_optimization.contiguous_gradients", False),
    (STAGE2, "zero_optimization.allgather_bucket_size", 2e8),
    (CHECKPOINTING, "activation_checkpointing.number_checkpoints", 4),
    (CHECKPOINTING, "activation_checkpointing.contiguous_memory_optimization", True),
    (CHECKPOINTING, "activation_checkpointing.synchronize_checkpoint_boundary", True),
    (CHECKPOINTING, "activation_checkpointing.profile", True),
    (BASE, "zero_offload.seed", 7),
]


@pytest.mark.parametrize("base, path, value", NO_EFFECT, ids=[path for _, path, _ in NO_EFFECT])
def test_a_key_without_effect_warns_once_naming_it(base, path, value):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(with_(base, path, value))
    assert [w.category for w in caught] == [UserWarning]
    message = str(caught[0].message)
    assert path in message and "no effect here" in message
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = load_config(base)
    assert cfg == plain and cfg.fingerprint() == plain.fingerprint()  # the value went nowhere


@pytest.mark.parametrize("base, path, value", NO_EFFECT, ids=[path for _, path, _ in NO_EFFECT])
def test_the_canonical_form_has_no_key_without_effect(base, path, value):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config(with_(base, path, value))
    canonical = cfg.to_dict()
    node = canonical
    for key in path.split(".")[:-1]:
        node = node[key]
    assert path.split(".")[-1] not in node
    with warnings.catch_warnings():
        warnings.simplefilter(
            "error"
        )  # what the engine writes back (checkpoints, check-config) loads quietly
        assert load_config(canonical) == cfg


def test_every_key_without_effect_is_in_one_warning():
    config = copy.deepcopy(ZERO2_OFFLOAD)
    for _, path, value in NO_EFFECT:
        config = with_(config, path, value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(config, world_size=4)
    assert len(caught) == 1
    assert all(path in str(caught[0].message) for _, path, _ in NO_EFFECT)
    assert cfg.activation_checkpointing.enabled
    assert cfg == load_config(with_(ZERO2_OFFLOAD, "activation_checkpointing", {}), world_size=4)


def test_refused_checkpointing_switches_stay_quiet_when_false():
    config = with_(
        BASE, "activation_checkpointing", {"partition_activations": False, "cpu_checkpointing": False}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(config).activation_checkpointing.enabled


def test_fingerprint_equal_for_equal_configs_and_different_otherwise():
    a = load_config(ZERO2_OFFLOAD, world_size=4)
    b = load_config(json.loads(json.dumps(ZERO2_OFFLOAD)), world_size=4)
    assert a == b and hash(a) == hash(b) and a.fingerprint() == b.fingerprint()
    # Spelling the defaults out, or 5e8 as an int, is the same config.
    explicit = with_(ZERO2_OFFLOAD, "zero_optimization.reduce_bucket_size", 500_000_000)
    explicit = with_(explicit, "zero_optimization.sub_group_size", 1e9)
    assert load_config(explicit, world_size=4).fingerprint() == a.fingerprint()
    changes = [
        ("fp16.initial_scale_power", 13),
        ("optimizer.params.lr", 3.1e-4),
        ("zero_optimization.offload_optimizer.pin_memory", False),
        ("zero_optimization.stage", 1),
        ("scheduler.params.total_num_steps", 1001),
        ("zero_offload.max_skipped_steps", 5),
        ("zero_offload.cpu_adam.impl", "torch"),
        ("gradient_clipping", 0.5),
    ]
    prints = {a.fingerprint()}
    for path, value in changes:
        prints.add(load_config(with_(ZERO2_OFFLOAD, path, value), world_size=4).fingerprint())
    assert len(prints) == len(changes) + 1
    other_world = load_config(without(ZERO2_OFFLOAD, "gradient_accumulation_steps"), world_size=8)
    assert other_world.fingerprint() != a.fingerprint()


def test_adam_type_defaults_to_decoupled_decay_like_deepspeed():
    adam = load_config(with_(BASE, "optimizer", {"type": "adam", "params": {"weight_decay": 0.01}}))
    assert adam.optimizer.type == "Adam" and adam.optimizer.adamw
    l2 = load_config(with_(BASE, "optimizer", {"type": "Adam", "params": {"adam_w_mode": False}}))
    assert not l2.optimizer.adamw
    assert load_config(with_(BASE, "optimizer", {"type": "ADAMW"})).optimizer.type == "AdamW"


def test_to_dict_round_trips():
    for config, world_size in [(ZERO2_OFFLOAD, 4), (BASE, 1), (STAGE2, 2)]:
        cfg = load_config(config, world_size=world_size)
        canonical = cfg.to_dict()
        assert json.loads(json.dumps(canonical)) == canonical
        assert load_config(canonical, world_size=world_size) == cfg
        assert load_config(canonical, world_size=world_size).fingerprint() == cfg.fingerprint()


def test_extension_section_and_round_trip():
    config = {
        **BASE,
        "activation_checkpointing": {"partition_activations": False},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": "/tmp/nvme"},
            "offload_optimizer": {"device": "cpu", "ratio": 0.5},
        },
        "bfloat16": {"enabled": True},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear"}},
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-4}},
        "zero_offload": {
            "device_memory": "512MiB",
            "cpu_adam": {"impl": "simd", "threads": 2},
            "delayed_param_update": {"enabled": True, "start_step": 0},
        },
    }
    cfg = load_config(config)
    assert cfg.precision == "bf16" and cfg.bf16.enabled
    assert cfg.activation_checkpointing.enabled
    assert (
        cfg.zero_optimization.offload_param.device == "nvme"
        and cfg.zero_optimization.offload_optimizer.ratio == 0.5
    )
    assert cfg.scheduler.params["warmup_max_lr"] == 1e-3  # DeepSpeed's default, not the optimizer's lr
    ext = cfg.zero_offload
    assert ext.device_memory == 512 * 2**20 and ext.cpu_adam.threads == 2
    assert ext.delayed_param_update.enabled and ext.delayed_param_update.start_step == 0
    assert load_config(cfg.to_dict()) == cfg
    assert "bf16" in cfg.to_dict() and "bfloat16" not in cfg.to_dict()


def test_torch_dtype():
    torch = pytest.importorskip("torch")
    assert load_config(BASE).torch_dtype is torch.float32
    assert load_config({**BASE, "fp16": {"enabled": True}}).torch_dtype is torch.float16
    assert load_config({**BASE, "bf16": {"enabled": True}}).torch_dtype is torch.bfloat16


def test_config_is_frozen_hashable_and_picklable():
    cfg = load_config(ZERO2_OFFLOAD, world_size=4)
    with pytest.raises(AttributeError):
        cfg.train_batch_size = 1
    with pytest.raises(TypeError):
        cfg.scheduler.params["warmup_num_steps"] = 1
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and again.fingerprint() == cfg.fingerprint() and {cfg: 1}[again] == 1
    err = pickle.loads(pickle.dumps(ConfigError("fp16.enabled", "fp16.enabled is wrong")))
    assert err.path == "fp16.enabled" and str(err) == "fp16.enabled is wrong"


def test_load_config_of_a_config():
    cfg = load_config({"train_batch_size": 64}, world_size=2)
    assert load_config(cfg, world_size=2) is cfg
    regrown = load_config(cfg, world_size=4)  # re-derived from the user's dict for the new world size
    assert (regrown.world_size, regrown.train_micro_batch_size_per_gpu, regrown.train_batch_size) == (
        4,
        16,
        64,
    )
    built = Config(train_batch_size=8, train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=1)
    assert load_config(built, world_size=2).train_batch_size == 16
    with pytest.raises(ConfigError, match="world size 3 cannot divide"):
        load_config(cfg, world_size=3)


def test_loading_does_not_modify_the_input():
    config = copy.deepcopy(ZERO2_OFFLOAD)
    load_config(config, world_size=4)
    assert config == ZERO2_OFFLOAD


ADAM = with_(BASE, "optimizer", {"type": "AdamW", "params": {"lr": 1e-3}})
WARMUP = with_(ADAM, "scheduler", {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}})


@pytest.mark.parametrize(
    "config, path",
    [
        (with_(ADAM, "optimizer.params.lr", math.inf), "optimizer.params.lr"),
        (with_(ADAM, "optimizer.params.eps", math.inf), "optimizer.params.eps"),
        (with_(ADAM, "optimizer.params.weight_decay", -math.inf), "optimizer.params.weight_decay"),
        (with_(WARMUP, "scheduler.params.warmup_max_lr", math.inf), "scheduler.params.warmup_max_lr"),
        (with_(BASE, "fp16", {"enabled": True, "loss_scale": math.inf}), "fp16.loss_scale"),
        (with_(BASE, "gradient_clipping", math.nan), "gradient_clipping"),
    ],
    ids=["lr", "eps", "weight_decay", "warmup_max_lr", "loss_scale", "clipping-nan"],
)
def test_infinite_or_nan_numbers_are_refused_naming_the_key(config, path):
    with pytest.raises(ConfigError, match="finite number") as info:
        load_config(config)
    assert info.value.path == path


def test_infinity_written_in_a_json_file_is_refused(tmp_path):
    file = tmp_path / "ds.json"
    file.write_text('{"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": Infinity}}}')
    with pytest.raises(ConfigError, match="optimizer.params.lr must be a finite number"):
        load_config(file)
