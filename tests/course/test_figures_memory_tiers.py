"""memory-tiers.png: its bars are the engine's own estimator's numbers for a 13B model, tier by tier."""

from __future__ import annotations

from tools.figures import memory_tiers
from zero_offload.basics import estimate_model_states

GB = 10**9


def _by_label() -> dict[str, memory_tiers.Row]:
    return {row.label.split("\n")[0]: row for row in memory_tiers.rows()}


def test_thirteen_billion_without_offload_is_208_gb_on_the_gpu():
    row = _by_label()["no offload"]
    assert row.tier("device") == 208 * GB
    assert row.tier("host") == row.tier("nvme") == 0
    assert dict(row.bytes["device"]) == {
        "parameters": 26 * GB,
        "gradients": 26 * GB,
        "master_weights": 52 * GB,
        "exp_avg": 52 * GB,
        "exp_avg_sq": 52 * GB,
    }


def test_zero_offload_keeps_the_fp16_params_on_the_gpu_and_16_bytes_a_param_on_the_host():
    rows = _by_label()
    for label in ("ZeRO-Offload", f"ZeRO-Offload, {memory_tiers.GPUS} GPUs"):
        row = rows[label]
        assert row.tier("device") == 26 * GB  # 2 B/param: stage 2 never shards the weights
        assert row.tier("host") == 208 * GB  # fp32 grads 4 + master 4 + m 4 + v 4, for the whole host
        assert dict(row.bytes["host"])["gradients"] == 52 * GB


def test_each_bar_is_the_estimator_per_tier():
    for (_, kwargs, ranks), row in zip(memory_tiers.CONFIGS, memory_tiers.rows(), strict=True):
        states = estimate_model_states(memory_tiers.PARAMS, **kwargs)
        assert row.tier("device") == states.device
        assert row.tier("host") == ranks * states.host
        assert row.tier("nvme") == ranks * states.nvme


def test_stage_3_offloads_leave_no_model_state_on_the_gpu():
    rows = memory_tiers.rows()
    cpu, nvme = rows[3], rows[4]
    assert cpu.tier("device") == nvme.tier("device") == 0
    assert cpu.tier("host") == 234 * GB  # 2 + 16 bytes a parameter
    assert nvme.tier("nvme") == 182 * GB and nvme.tier("host") == 52 * GB  # the fp32 gradients stay in DRAM


def test_the_capacities_are_those_the_figure_draws():
    assert memory_tiers.GPU_CAPACITY == 80 * GB
    assert memory_tiers.HOST_CAPACITY == 512 * GB
    assert "memory-tiers.png" in memory_tiers.FIGURES
