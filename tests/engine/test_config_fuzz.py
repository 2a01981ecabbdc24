"""Whatever JSON a user writes, the config reader answers with a Config or a ConfigError, never another exception.

The objects are built from the schema's own key names (top level and nested sections), so that most of them get
past the first check and reach the deeper readers, with values of every wrong type and extreme size mixed in.
"""

from __future__ import annotations

import warnings

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zero_offload.config import Config, ConfigError, load_config

OFFLOAD = {"device": None, "nvme_path": None, "pin_memory": None, "buffer_count": None, "ratio": None,
           "fast_init": None}  # fmt: skip
SCHEMA = {
    "train_batch_size": None,
    "train_micro_batch_size_per_gpu": None,
    "gradient_accumulation_steps": None,
    "gradient_clipping": None,
    "steps_per_print": None,
    "wall_clock_breakdown": None,
    "fp16": {"enabled": None, "loss_scale": None, "initial_scale_power": None, "loss_scale_window": None,
             "hysteresis": None, "consecutive_hysteresis": None, "min_loss_scale": None, "auto_cast": None,
             "fp16_master_weights_and_grads": None},
    "bf16": {"enabled": None, "immediate_grad_update": None},
    "amp": {"enabled": None, "opt_level": None},
    "optimizer": {"type": None, "legacy_fusion": None,
                  "params": {"lr": None, "betas": None, "eps": None, "weight_decay": None, "adam_w_mode": None,
                             "bias_correction": None, "amsgrad": None, "max_grad_norm": None, "torch_adam": None}},
    "scheduler": {"type": None,
                  "params": {"warmup_min_lr": None, "warmup_max_lr": None, "warmup_num_steps": None,
                             "warmup_type": None, "total_num_steps": None, "warmup_min_ratio": None,
                             "cos_min_ratio": None, "last_batch_iteration": None}},
    "zero_optimization": {"stage": None, "offload_optimizer": OFFLOAD, "offload_param": OFFLOAD,
                          "overlap_comm": None, "contiguous_gradients": None, "reduce_bucket_size": None,
                          "allgather_bucket_size": None, "stage3_prefetch_bucket_size": None,
                          "sub_group_size": None, "cpu_offload": None,
                          "stage3_max_live_parameters": None},
    "activation_checkpointing": {"partition_activations": None, "cpu_checkpointing": None,
                                 "contiguous_memory_optimization": None, "number_checkpoints": None,
                                 "synchronize_checkpoint_boundary": None, "profile": None},
    "zero_offload": {"device_memory": None, "overlap_offload": None, "staging_slots": None,
                     "max_skipped_steps": None, "seed": None,
                     "cpu_adam": {"impl": None, "threads": None, "variant": None},
                     "delayed_param_update": {"enabled": None, "start_step": None},
                     "cores": {"device": None, "host": None}},
}  # fmt: skip
# Values that are right for their key, so that a config often gets as far as the checks between keys.
PLAUSIBLE = {
    "type": ["Adam", "AdamW", "adamw", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "SGD"],
    "device": ["none", "cpu", "nvme", "CPU", [0], [0, 1], [0, 0]],
    "host": [[1], [0], []],
    "impl": ["simd", "torch", "naive", "avx"],
    "warmup_type": ["log", "linear", "cos"],
    "nvme_path": ["/tmp/zo_nvme", ""],
    "device_memory": ["512MiB", "1e400MB", "0.5GB", "-1MB", "512 XB", "nanMB"],
    "betas": [[0.9, 0.999], [0.9], [1.0, 0.5], [None, 0.9], ["0.9", 0.9]],
    "stage": [0, 1, 2, 3, 4],
}
SWITCHES = ("enabled", "pin_memory", "fast_init", "consecutive_hysteresis", "auto_cast", "immediate_grad_update",
            "fp16_master_weights_and_grads", "legacy_fusion", "adam_w_mode", "bias_correction", "amsgrad",
            "torch_adam", "overlap_comm", "contiguous_gradients", "cpu_offload", "partition_activations",
            "cpu_checkpointing", "contiguous_memory_optimization", "synchronize_checkpoint_boundary", "profile",
            "overlap_offload", "wall_clock_breakdown")  # fmt: skip
COUNTS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
          "loss_scale_window", "hysteresis", "buffer_count", "staging_slots", "max_skipped_steps", "seed",
          "start_step", "threads", "number_checkpoints", "warmup_num_steps", "total_num_steps",
          "initial_scale_power", "last_batch_iteration", "stage3_max_live_parameters")  # fmt: skip
NUMBERS = ("gradient_clipping", "loss_scale", "min_loss_scale", "lr", "eps", "weight_decay", "ratio",
           "warmup_min_lr", "warmup_max_lr", "warmup_min_ratio", "cos_min_ratio")  # fmt: skip
SIZES = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "sub_group_size")
GOOD = {
    **{name: st.booleans() for name in SWITCHES},
    **{name: st.sampled_from([1, 2, 4, 8]) for name in COUNTS},
    **{name: st.floats(0, 1) | st.sampled_from([1e-3, 1]) for name in NUMBERS},
    **{name: st.sampled_from([5e8, 1000, 2**20, 1.5]) for name in SIZES},
    **{name: st.sampled_from(values) for name, values in PLAUSIBLE.items()},
}
JUNK = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, 2, -1, 10**100, 2**63])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6),  # no "auto": refused anywhere in the tree before any section is read
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


def _value(name: str, sub: dict | None):
    # Mostly right values: one wrong value stops the read, and the readers after it would go untried.
    good = _section(sub) if sub is not None else GOOD.get(name)
    return JUNK if good is None else st.sampled_from([good] * 7 + [JUNK]).flatmap(lambda chosen: chosen)


def _section(schema: dict, required=()):
    optional = {name: _value(name, sub) for name, sub in schema.items() if name not in required}
    optional["not_a_key"] = JUNK  # now and then an unknown key, which must be named
    return st.fixed_dictionaries({name: _value(name, None) for name in required}, optional=optional)


# A string at the top is a file name to load_config: the file reader has tests of its own.
CONFIGS = (
    _section(SCHEMA, required=("train_batch_size",))
    | _section(SCHEMA)
    | JUNK.filter(lambda value: not isinstance(value, str))
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=CONFIGS, world_size=st.sampled_from([1, 2, 4]))
def test_the_config_reader_answers_any_json_with_a_config_or_a_config_error(data, world_size):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warning about tolerated DeepSpeed keys
        try:
            config = load_config(data, world_size=world_size)
        except ConfigError as err:
            assert str(err)  # a message to show
            return
        assert isinstance(config, Config)
        # What was accepted must survive its own canonical form.
        assert load_config(config.to_dict(), world_size=world_size) == config
