"""The advisor (tuning/advisor.py, module 4): what it recommends, and the introduction's table of mistakes as
rules that fire on crafted inputs and not otherwise."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zero_offload.tuning.advisor import advise, recommend
from zero_offload.tuning.perfmodel import PRESETS, Workload, plan, plan_all

B = 10**9
ONE_A100 = replace(PRESETS["a100-80g"], gpus=1, gpu_memory=80 * B, host_memory=256 * B)
THIRTEEN_B = Workload(13 * B)


def _rules(hw, wl, stage, offload):
    return {a.rule: a for a in advise(hw, wl, plan(hw, wl, stage, offload), plan_all(hw, wl))}


def test_what_fits_is_recommended_without_offload_and_nothing_fitting_says_so():
    rec = recommend(ONE_A100, Workload(B))
    assert rec.plan.offload == "none" and "offload_optimizer" not in rec.config["zero_optimization"]
    eight = recommend(replace(ONE_A100, gpus=8, host_memory=2048 * B), Workload(7 * B))
    assert eight.plan.label == "stage 2"  # as fast as stage 1 on 8 GPUs, and the least memory
    rec = recommend(ONE_A100, Workload(1000 * B))
    assert rec.plan is None and rec.reasons[0].startswith("nothing fits")


def test_activation_checkpointing_is_recommended_when_only_it_makes_the_batch_fit():
    wl = Workload(13 * B, batch=8)
    assert not any(p.fits for p in plan_all(ONE_A100, wl))
    rec = recommend(ONE_A100, wl)
    assert rec.workload.recompute and "activation_checkpointing" in rec.config
    assert "activation checkpointing" in rec.reasons[0]


# -- the introduction's table of mistakes, as rules that fire on crafted inputs and not otherwise --------------
def test_offload_not_needed_fires_only_when_the_model_fits_on_the_device():
    assert "offload-not-needed" in _rules(ONE_A100, Workload(B), 2, "optimizer")
    assert "offload-not-needed" not in _rules(
        replace(ONE_A100, host_memory=512 * B), THIRTEEN_B, 2, "optimizer"
    )


def test_cpu_step_dominates_fires_only_when_the_cpu_is_slower_than_compute():
    slow = replace(ONE_A100, cpu_adam_params_per_s=1e8)
    fast = replace(ONE_A100, cpu_adam_params_per_s=1e12, cpu_adam_thread_params_per_s=1e11)
    assert "cpu-step-dominates" in _rules(slow, Workload(B), 2, "optimizer")
    assert "cpu-step-dominates" not in _rules(fast, Workload(B), 2, "optimizer")
    # Too few threads: the advice names the saturation point (7 here: one socket), not cores / GPUs (128).
    few_threads = replace(ONE_A100, cpu_adam_threads=2)
    message = _rules(few_threads, THIRTEEN_B, 2, "optimizer")["cpu-step-dominates"].message
    assert "give the CPU Adam 7 threads a rank (2 now: 1.43 against 4.39 Gparam/s)" in message
    assert "threads a rank" not in _rules(ONE_A100, THIRTEEN_B, 2, "optimizer")["cpu-step-dominates"].message


def test_pin_memory_quotes_the_measured_ratio_when_there_is_one():
    measured = replace(ONE_A100, pageable_link_gb_per_s=ONE_A100.link_gb_per_s / 3)
    assert "3.0x faster" in _rules(measured, THIRTEEN_B, 2, "optimizer")["pin-memory"].message
    assert "measure the gain" in _rules(ONE_A100, THIRTEEN_B, 2, "optimizer")["pin-memory"].message
    assert "pin-memory" not in _rules(ONE_A100, THIRTEEN_B, 0, "none")
    assert "pin-memory-limit" in _rules(ONE_A100, THIRTEEN_B, 2, "optimizer")  # 260 of 256 GB pinned
    assert "pin-memory-limit" not in _rules(
        replace(ONE_A100, host_memory=2048 * B), THIRTEEN_B, 2, "optimizer"
    )


def test_offload_param_is_flagged_where_stage_2_with_optimizer_offload_fits():
    roomy = replace(ONE_A100, host_memory=512 * B)
    rule = _rules(roomy, THIRTEEN_B, 3, "optimizer+param")["offload-param-not-needed"]
    assert "78.0 GB a step" in rule.message and "52.0 GB" in rule.message
    small_gpu = replace(roomy, gpu_memory=20 * B)  # here only offload_param fits
    assert plan(small_gpu, THIRTEEN_B, 3, "optimizer+param").fits
    assert "offload-param-not-needed" not in _rules(small_gpu, THIRTEEN_B, 3, "optimizer+param")
    eight = replace(roomy, gpus=8, host_memory=2048 * B)
    assert "stage3-traffic" in _rules(eight, THIRTEEN_B, 3, "none")
    assert "stage3-traffic" not in _rules(roomy, THIRTEEN_B, 3, "optimizer")  # one GPU: as fast as stage 2


def test_stage3_with_every_offload_is_compared_with_stage2_and_optimizer_offload():
    # The introduction's mistake: stage 3 and offload everywhere where stage 2 + optimizer offload fits.
    for hw in (replace(ONE_A100, host_memory=512 * B), replace(ONE_A100, gpus=8, host_memory=2048 * B)):
        chosen, stage2 = plan(hw, THIRTEEN_B, 3, "optimizer+param"), plan(hw, THIRTEEN_B, 2, "optimizer")
        assert stage2.fits and stage2.time.serial < chosen.time.serial
        rule = _rules(hw, THIRTEEN_B, 3, "optimizer+param")["stage3-traffic"]
        assert rule.level == "warning" and "stage 2 + optimizer offload fits" in rule.message
        assert (
            f"predicted {stage2.time.serial:.3g} s a step against {chosen.time.serial:.3g} s" in rule.message
        )
        extra = (chosen.pcie_bytes - stage2.pcie_bytes) / B
        assert (
            extra == pytest.approx(2 * 13 / hw.gpus) and f"{extra:.1f} GB more a step per GPU" in rule.message
        )
    small_gpu = replace(ONE_A100, host_memory=512 * B, gpu_memory=20 * B)  # stage 2 + optimizer offload: no
    assert "stage3-traffic" not in _rules(small_gpu, THIRTEEN_B, 3, "optimizer+param")


@pytest.mark.parametrize(
    "precision, offload", [("fp16", "optimizer"), ("fp32", "optimizer"), ("fp16", "optimizer+param")]
)
def test_host_memory_is_computed_per_parameter(precision, offload):
    wl = Workload(13 * B, precision=precision)
    rule = _rules(ONE_A100, wl, 3, offload)["host-memory"]
    assert "= 20.0 bytes a parameter" in rule.message and rule.level == "error"  # 260 GB on a 256 GB host
    assert _rules(replace(ONE_A100, host_memory=512 * B), wl, 3, offload)["host-memory"].level == "info"
