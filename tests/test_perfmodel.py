"""The performance model, its advisor and `zo plan` (module 4): memory, fit, step time, rules, calibration.

How close the calibrated prediction comes to the engine's measured CPU step is a timing, reported by
`make bench` (cli/bench/cpu.py, model_vs_engine), never asserted here: these tests check the model's structure."""

from __future__ import annotations

import math
import shutil
from dataclasses import replace

import pytest
import torch

from zero_offload.basics.memory import estimate_model_states
from zero_offload.cli import main
from zero_offload.tuning import bandwidth, cpuinfo, hardware, perfmodel
from zero_offload.tuning.advisor import advise, recommend, smallest_ratio
from zero_offload.tuning.partial import estimate_partial_offload
from zero_offload.tuning.perfmodel import (
    PRESETS,
    Workload,
    cached_share,
    calibrate,
    cpu_adam_seconds,
    hardware_preset,
    plan,
    plan_all,
)
from zero_offload.tuning.plan_report import describe, engine_only_keys, format_recommendation

B = 10**9
ONE_A100 = replace(PRESETS["a100-80g"], gpus=1, gpu_memory=80 * B, host_memory=256 * B)
THIRTEEN_B = Workload(13 * B)


def _rules(hw, wl, stage, offload):
    return {a.rule: a for a in advise(hw, wl, plan(hw, wl, stage, offload), plan_all(hw, wl))}


# -- memory: the model reuses the estimator, and the introduction's 13B example --------------------------------
@pytest.mark.parametrize("gpus", [1, 4])
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_bytes_per_tier_are_estimate_model_states(gpus, precision):
    hw, wl = replace(ONE_A100, gpus=gpus), Workload(3 * B, precision=precision)
    for p in plan_all(hw, wl):
        expected = estimate_model_states(wl.params, stage=p.stage, world_size=gpus, precision=precision,
                                         offload_optimizer="cpu" if p.ratio else "none",
                                         offload_param="cpu" if p.offload == "optimizer+param" else "none")  # fmt: skip
        assert p.states.bytes == expected.bytes, p.label
        assert p.device_bytes == expected.device + p.activations + p.buffers
    partial = plan(hw, wl, 2, "optimizer", 0.4)
    expected = estimate_partial_offload(
        wl.params, stage=2, world_size=gpus, precision=precision, host_fraction=0.4
    )
    assert partial.states.bytes == expected.bytes


def test_13b_on_one_80gb_gpu():
    plans = {(p.stage, p.offload): p for p in plan_all(ONE_A100, THIRTEEN_B)}
    for stage in (0, 1, 2, 3):  # 16 bytes a parameter of model states: 208 GB, on the device
        assert plans[stage, "none"].device_bytes > plans[stage, "none"].device_usable
    offloaded = plans[2, "optimizer"]
    assert offloaded.states.device == 2 * 13 * B  # only the fp16 weights stay: 26 GB
    assert offloaded.device_bytes == 26 * B + offloaded.activations + offloaded.buffers
    assert offloaded.device_bytes <= offloaded.device_usable  # ... which fits in 80 GB
    assert offloaded.states.host == 16 * 13 * B  # fp32 gradient, master, m, v: 208 GB
    assert offloaded.host_bytes == 20 * 13 * B  # and the fp16 staging buffers: 20 bytes a parameter
    assert not offloaded.fits  # ... which a 256 GB host (less 10%) cannot hold
    assert offloaded.pcie_bytes == 4 * 13 * B  # fp16 gradients down, fp16 weights up
    assert plans[3, "optimizer+param"].pcie_bytes == 6 * 13 * B  # the weights go up for forward and backward
    rec = recommend(ONE_A100, THIRTEEN_B)  # so part of the optimizer stays on the device
    assert rec.plan.label == "stage 2 + optimizer offload (ratio 0.8)" and rec.plan.fits
    assert rec.config["zero_optimization"]["offload_optimizer"] == {
        "device": "cpu",
        "pin_memory": True,
        "ratio": 0.8,
    }
    assert smallest_ratio(ONE_A100, THIRTEEN_B, 2) == 0.8
    assert plan(ONE_A100, THIRTEEN_B, 2, "optimizer", 0.75).device_bytes > ONE_A100.gpu_memory * 0.92
    # DeepSpeed takes a partial offload at stage 3 only: the printed config says which keys are this engine's.
    report = format_recommendation(rec)
    assert "not for DeepSpeed: zero_optimization.offload_optimizer.ratio at stage 2" in report
    assert "not for DeepSpeed: zero_offload" in report
    stage3 = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}
    assert engine_only_keys(stage3) == []


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


# -- time: the formulas, and which way they move ---------------------------------------------------------------
def test_compute_is_6_flops_per_parameter_and_token():
    wl = Workload(2 * B, batch=4, seq_len=512)
    peak = ONE_A100.gpu_tflops * 1e12 * ONE_A100.mfu
    assert plan(ONE_A100, wl, 0).time.compute == pytest.approx(6 * 2 * B * 4 * 512 / peak)
    assert plan(ONE_A100, replace(wl, recompute=True), 0).time.compute == pytest.approx(
        8 * 2 * B * 4 * 512 / peak
    )


def test_pcie_is_full_duplex_serial_adds_the_directions_and_overlapped_takes_the_longer():
    # 1B parameters, one GPU, 10 GB/s a direction: 2 GB of fp16 gradients down and 2 GB of weights up.
    hw = replace(ONE_A100, link_gb_per_s=10)
    t = plan(hw, Workload(B), 2, "optimizer").time
    assert (t.pcie_down, t.pcie_up) == (pytest.approx(0.2), pytest.approx(0.2))
    assert t.pcie == pytest.approx(0.4) and t.pcie_duplex == pytest.approx(0.2)
    assert t.serial == pytest.approx(t.compute + t.gpu_adam + t.comm + 0.4 + t.cpu_adam)
    assert t.busy()["PCIe"] == pytest.approx(0.2)  # both directions at once, not 0.4
    # offload_param: the weights go up for forward and backward (4 GB), the gradients down once (2 GB).
    param = plan(hw, Workload(B), 3, "optimizer+param").time
    assert (param.pcie_down, param.pcie_up, param.pcie_duplex) == pytest.approx((0.2, 0.4, 0.4))
    # A fast CPU and a slow link: the overlapped step is the longer direction, not the sum.
    fast_cpu = replace(hw, cpu_adam_params_per_s=1e13, cpu_adam_thread_params_per_s=1e13, link_gb_per_s=1)
    slow = plan(fast_cpu, Workload(B), 2, "optimizer").time
    assert slow.bottleneck == "PCIe" and slow.overlapped == pytest.approx(2.0)


def test_13b_on_one_a100_is_cpu_bound_at_batch_1_and_gpu_bound_once_compute_passes_the_cpu_step():
    def at(batch, hw=ONE_A100):
        return plan(hw, Workload(13 * B, batch=batch, recompute=True), 2, "optimizer").time

    # PCIe: 26 GB each way at 25 GB/s = 1.04 s, shorter than the CPU step: never the bottleneck here.
    assert at(1).pcie_duplex == pytest.approx(1.04) and at(1).pcie == pytest.approx(2.08)
    # One rank on one socket of two: 13e9 / 4.39 Gparam/s = 2.96 s, so the CPU until compute passes it.
    assert [at(b).bottleneck for b in (1, 2, 3, 4)] == ["CPU Adam", "CPU Adam", "CPU Adam", "GPU"]
    spread = replace(ONE_A100, numa_spread=True, cpu_adam_threads=13)  # both sockets: 1.49 s
    assert [at(b, spread).bottleneck for b in (1, 2)] == ["CPU Adam", "GPU"]


def test_the_cpu_step_is_calls_plus_parameters_at_the_throughput():
    hw = replace(ONE_A100, cpu_adam_params_per_s=1e9, cpu_adam_call_seconds=1e-4, sockets=1)
    assert plan(hw, Workload(B, units=50), 2, "optimizer").time.cpu_adam == pytest.approx(50e-4 + 1.0)
    assert plan(hw, Workload(B, units=50), 2, "optimizer", 0.5).time.cpu_adam == pytest.approx(25e-4 + 0.5)
    assert plan(hw, Workload(B), 2).time.cpu_adam == 0


def test_the_host_throughput_is_shared_by_its_ranks_and_reached_with_enough_threads():
    a100 = PRESETS["a100-80g"]  # 8 ranks share 8.78 Gparam/s; one thread does 0.714
    wl = Workload(8 * B, units=1)
    per_rank = a100.cpu_adam_params_per_s / 8
    assert plan(a100, wl, 2, "optimizer").time.cpu_adam == pytest.approx(30e-6 + B / per_rank)
    one_thread = replace(a100, cpu_adam_threads=1)  # one thread falls short of the rank's share
    assert plan(one_thread, wl, 2, "optimizer").time.cpu_adam == pytest.approx(
        30e-6 + B / a100.cpu_adam_thread_params_per_s
    )
    # Threads to recommend: where the rank reaches its share, not every core the rank could have.
    assert a100.cpu_adam_saturating_threads() == 2  # ceil(1.10 / 0.714)
    assert ONE_A100.cpu_adam_saturating_threads() == 7  # one rank has one socket of two: ceil(4.39 / 0.714)
    assert replace(ONE_A100, cpu_cores=6).cpu_adam_saturating_threads() == 6  # never more than the cores
    for hw in (a100, ONE_A100):
        threads = hw.cpu_adam_saturating_threads()
        assert hw.cpu_adam_rank_params_per_s(threads) == pytest.approx(
            hw.cpu_adam_params_per_s / hw.sockets / (hw.gpus // hw.sockets or 1)
        )
        assert hw.cpu_adam_rank_params_per_s(threads - 1) < hw.cpu_adam_rank_params_per_s(threads)
    rec = recommend(ONE_A100, THIRTEEN_B)
    assert rec.config["zero_offload"]["cpu_adam"]["threads"] == 7
    assert any(
        r.startswith("CPU Adam threads: 7 per rank") and "more would add nothing" in r for r in rec.reasons
    )
    assert "a rank with 16 thread(s) reaches 4.39" in describe(ONE_A100, THIRTEEN_B)


def test_step_time_grows_with_parameters_and_falls_with_link_bandwidth():
    for stage, offload in [(p.stage, p.offload) for p in plan_all(ONE_A100, THIRTEEN_B)]:
        by_size = [
            plan(ONE_A100, Workload(n), stage, offload).time.serial for n in (10**8, B, 10 * B, 100 * B)
        ]
        assert by_size == sorted(by_size) and by_size[0] < by_size[-1], (stage, offload)
        by_link = [plan(replace(ONE_A100, link_gb_per_s=g), THIRTEEN_B, stage, offload).time.serial
                   for g in (4, 8, 16, 32, 64)]  # fmt: skip
        if offload == "none":
            assert len(set(by_link)) == 1
        else:
            assert by_link == sorted(by_link, reverse=True) and by_link[0] > by_link[-1], (stage, offload)


def test_impossible_choices_are_errors_that_name_the_fix():
    with pytest.raises(ValueError, match="stage 3"):
        plan(ONE_A100, THIRTEEN_B, 2, "optimizer+param")
    with pytest.raises(ValueError, match="stage >= 1"):
        plan(ONE_A100, THIRTEEN_B, 0, "optimizer")
    with pytest.raises(ValueError, match="keep ratio 1"):
        plan(ONE_A100, THIRTEEN_B, 3, "optimizer+param", 0.5)
    with pytest.raises(ValueError, match="at least 1 GPU"):
        plan(replace(ONE_A100, gpus=0), THIRTEEN_B, 2)
    with pytest.raises(ValueError, match="v100-32g, a100-80g, h200, this-cpu"):
        hardware_preset("tpu")
    with pytest.raises(ValueError, match="fp16, bf16, fp32"):
        Workload(B, precision="fp8")


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


# -- the CPU step's structure: what it counts, and how it grows --------------------------------------------------
MiB = 2**20
# A calibrated-looking host: 1 Gparam/s from memory, 4 from the cache, which keeps 64 MiB of states.
CACHED = replace(ONE_A100, cpu_adam_params_per_s=1e9, cpu_adam_thread_params_per_s=1e9, cpu_adam_threads=1,
                 cpu_adam_call_seconds=2e-5, cpu_adam_step_seconds=3e-4, cpu_adam_cached_params_per_s=4e9,
                 cpu_adam_cache_bytes=64 * MiB, sockets=1)  # fmt: skip


def test_the_cpu_step_counts_its_start_its_calls_and_its_parameters():
    cold = replace(CACHED, cpu_adam_cache_bytes=0)  # nothing kept: every parameter at memory's speed
    assert cpu_adam_seconds(cold, 1e8, 10) == pytest.approx(3e-4 + 10 * 2e-5 + 1e8 / 1e9)
    tiny = cpu_adam_seconds(CACHED, 1e3, 1)  # 16 KB of states: all but a sliver of them cached
    assert tiny == pytest.approx(3e-4 + 2e-5 + 1e3 * (1 / 4e9 + (16e3 / (64 * MiB)) * (1 / 1e9 - 1 / 4e9)))
    # Half the cache's bytes: half the parameters at each speed (fp32: 16 bytes of states a parameter).
    half = 32 * MiB / 16
    assert cpu_adam_seconds(CACHED, half, 0) == pytest.approx(3e-4 + half * (0.5 / 4e9 + 0.5 / 1e9))
    # fp16 training writes the 16-bit weights too: 18 bytes a parameter, so less of them fits.
    assert cpu_adam_seconds(CACHED, half, 0, "fp16") > cpu_adam_seconds(CACHED, half, 0, "fp32")


def test_the_cached_share_falls_from_all_to_none_at_the_measured_cache_bytes():
    assert cached_share(CACHED, 0) == 1 and cached_share(CACHED, 16 * MiB) == pytest.approx(0.75)
    assert cached_share(CACHED, 64 * MiB) == 0 and cached_share(CACHED, 1e12) == 0
    for preset in PRESETS.values():  # presets measured no cache: every parameter at memory's speed
        assert cached_share(preset, 0) == 0
    # The ranks of a host share its cache: two ranks of 1M parameters each keep less of theirs cached.
    two = replace(CACHED, gpus=2, cpu_adam_params_per_s=2e9)
    assert cpu_adam_seconds(two, 1e6, 0) > cpu_adam_seconds(CACHED, 1e6, 0)


SIZES = (10**4, 10**5, 10**6, 4 * 10**6, 10**7, 10**8, 10**9)


@pytest.mark.parametrize("hw", [CACHED, replace(CACHED, cpu_adam_cache_bytes=0), PRESETS["a100-80g"]])
def test_the_predicted_cpu_step_grows_with_parameters_and_with_tensors(hw):
    def cpu_step(hw, params, units):
        return plan(hw, Workload(params, precision="fp32", units=units), 2, "optimizer").time.cpu_adam

    by_params = [cpu_step(hw, n, 16) for n in SIZES]
    assert by_params == sorted(by_params) and len(set(by_params)) == len(by_params)
    by_tensors = [cpu_step(hw, 4 * 10**6, units) for units in (1, 4, 16, 64, 256)]
    assert by_tensors == sorted(by_tensors) and len(set(by_tensors)) == len(by_tensors)
    # Each parameter's own time never falls as the states grow: less of them stays cached.
    elements = replace(hw, cpu_adam_step_seconds=0.0, cpu_adam_call_seconds=0.0)
    per_param = [cpu_step(elements, n, 1) / n for n in SIZES]
    assert all(b >= a * (1 - 1e-12) for a, b in zip(per_param, per_param[1:], strict=False))


def test_the_cache_bytes_are_twice_where_the_probes_cross_halfway():
    probes = [(8 * MiB, 4e9), (16 * MiB, 4e9), (24 * MiB, 2.5e9), (32 * MiB, 1.6e9), (64 * MiB, 1e9)]
    # Halfway between 1/4e9 and 1/1e9 is 0.625 ns a parameter: between 16 MiB (0.25) and 24 MiB (0.4) it is
    # not, between 24 and 32 MiB (0.625) exactly at 32 MiB.
    assert bandwidth.cache_bytes_from_probes(probes, 4e9) == 64 * MiB
    assert (
        bandwidth.cache_bytes_from_probes(probes[:2] + [(32 * MiB, 1e9)], 4e9)
        == 2 * (16 + 16 * 0.375 / 0.75) * MiB
    )
    flat = [(8 * MiB, 1e9), (64 * MiB, 1.05e9)]  # no probe faster than halfway: the cache keeps nothing
    assert bandwidth.cache_bytes_from_probes(flat, 1.05e9) == 0
    # The smallest states slower than the next (a call weighs more on them): the search starts at the fastest.
    slow_start = [(8 * MiB, 2e9), (16 * MiB, 4e9), (32 * MiB, 1e9)]
    assert bandwidth.cache_bytes_from_probes(slow_start, 4e9) == 2 * (16 + 16 * 0.375 / 0.75) * MiB


# -- calibration: sane figures, whatever this machine's speed ---------------------------------------------------
HAS_COMPILER = any(shutil.which(cc) for cc in ("cc", "gcc", "clang"))


def _finite_positive(*values) -> bool:
    return all(math.isfinite(v) and v > 0 for v in values)


def test_calibrate_describes_this_machine():
    hw = calibrate(threads=1, precision="fp32", numel=1 << 20, repeats=2)
    assert hw.name == "this-cpu" and hw.cpu_adam_threads == 1
    assert _finite_positive(
        hw.cpu_adam_params_per_s, hw.host_memory_gb_per_s, hw.link_gb_per_s, hw.gpu_tflops
    )
    assert hw.cpu_adam_thread_params_per_s == hw.cpu_adam_params_per_s  # one thread measured: the host's
    assert math.isfinite(hw.cpu_adam_call_seconds) and hw.cpu_adam_call_seconds >= 0
    assert math.isfinite(hw.cpu_adam_step_seconds) and hw.cpu_adam_step_seconds >= 0
    assert hw.host_memory > 2**30 and hw.cpu_cores >= 1
    if HAS_COMPILER:  # the host's bandwidth is the memory floor's: no Adam moves its bytes faster
        assert hw.host_memory_gb_per_s * 1e9 / 28 * (1 + 1e-9) >= hw.cpu_adam_params_per_s
    if hw.cpu_adam_cached_params_per_s is not None:  # the cache: never slower than memory, a size or none
        assert _finite_positive(hw.cpu_adam_cached_params_per_s)
        assert hw.cpu_adam_cached_params_per_s >= hw.cpu_adam_params_per_s and hw.cpu_adam_cache_bytes >= 0
        assert "the cache keeps" in hw.notes
        if hw.cpu_adam_cache_bytes:
            assert "on states still in the cache" in describe(hw, THIRTEEN_B)
    if not torch.cuda.is_available():  # the emulated device's "link" is a host memory copy, and says so
        assert hw.link_kind == "host memcpy" and "device-host link (host memcpy)" in describe(hw, THIRTEEN_B)


def test_calibrating_a_preset_replaces_its_cpu_figures_and_keeps_its_capacities():
    v100 = PRESETS["v100-32g"]
    based = calibrate(v100, threads=1, numel=1 << 20, repeats=2)
    assert based.name == "v100-32g+calibrated" and based.cpu_adam_threads == 1
    assert based.cpu_adam_params_per_s != v100.cpu_adam_params_per_s
    assert based.host_memory_gb_per_s != v100.host_memory_gb_per_s
    kept = ("gpus", "gpu_memory", "host_memory", "cpu_cores", "gpu_tflops", "gpu_memory_gb_per_s")
    assert all(getattr(based, name) == getattr(v100, name) for name in kept)
    if not torch.cuda.is_available():  # a host copy is not the preset's PCIe link
        assert (based.link_gb_per_s, based.link_kind) == (v100.link_gb_per_s, "PCIe")


def test_calibrate_sweeps_thread_counts_up_to_the_ranks(monkeypatch):
    def profile(*, threads, form, numel, repeats):
        rate = min(threads, 3) * 1e8  # memory saturates at 3 threads
        return bandwidth.AdamProfile("C SIMD", form, threads, rate, 1e-5, 0.0, "", 28 * 3e8 / 1e9)

    probed = []

    def cache(memory, last_level, repeats):
        probed.append(memory.threads)
        return bandwidth.CacheProfile(9e8, 48 * MiB, ())

    monkeypatch.setattr(bandwidth, "cpu_adam_profile", profile)
    monkeypatch.setattr(bandwidth, "cache_profile", cache)
    monkeypatch.setattr(hardware, "cpu_caches", lambda: cpuinfo.Caches(l3=32 * MiB))
    assert hardware.sweep_threads(6) == [1, 2, 4, 6]
    hw = calibrate(PRESETS["a100-80g"], threads=6, numel=1 << 16, repeats=1)
    assert (hw.cpu_adam_params_per_s, hw.cpu_adam_thread_params_per_s, hw.cpu_adam_threads) == (3e8, 1e8, 6)
    assert hw.host_memory_gb_per_s == pytest.approx(8.4)
    assert replace(hw, gpus=1).cpu_adam_saturating_threads() == 3
    # the cache is probed once, at the rank's own threads
    assert probed == [6] and (hw.cpu_adam_cached_params_per_s, hw.cpu_adam_cache_bytes) == (9e8, 48 * MiB)
    monkeypatch.setattr(hardware, "cpu_caches", lambda: cpuinfo.Caches())  # the OS says nothing of its caches
    hw = calibrate(PRESETS["a100-80g"], threads=6, numel=1 << 16, repeats=1)
    assert probed == [6] and (hw.cpu_adam_cached_params_per_s, hw.cpu_adam_cache_bytes) == (None, 0)


# -- `zo plan` ---------------------------------------------------------------------------------------------------
ARGS_13B = ["plan", "--params", "13B", "--gpus", "1", "--gpu-memory", "80GB", "--host-memory", "256GB"]


def test_zo_plan_prints_every_configuration_and_the_recommendation(capsys):
    assert main(ARGS_13B) == 0
    out = capsys.readouterr().out
    for label in ("stage 0 ", "stage 1 + optimizer offload", "stage 3 + optimizer+param offload"):
        assert label in out
    assert "no: device" in out and "no: host" in out and "260.0 GB" in out
    assert "Recommendation: stage 2 + optimizer offload (ratio 0.8)" in out and '"ratio": 0.8' in out
    assert "[host-memory]" in out and "16.0 bytes a parameter" in out


def test_zo_plan_checks_the_users_own_choice(capsys):
    assert main(["plan", "--params", "1B", "--gpus", "1", "--stage", "2", "--offload", "optimizer"]) == 0
    assert "Your choice, stage 2 + optimizer offload: fits" in capsys.readouterr().out
    assert main([*ARGS_13B, "--stage", "2", "--offload", "optimizer+param"]) == 2
    assert "needs ZeRO stage 3" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [(["--gpus", "0"], "--gpus must be at least 1 (--gpus 1 for a single GPU)"),
     (["--batch", "0"], "--batch must be at least 1"), (["--link", "-3"], "--link must be more than 0"),
     (["--mfu", "1.5"], "--mfu is a share")],
)  # fmt: skip
def test_zo_plan_rejects_bad_numbers_and_says_what_is_expected(capsys, extra, message):
    assert main([*ARGS_13B, *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [(["--gpu-memory", "80XB"], "cannot read '80XB' as a byte size"),
                                            (["--params", "lots"], "cannot read 'LOTS' as a parameter count")])  # fmt: skip
def test_zo_plan_rejects_unreadable_sizes(capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        main([*ARGS_13B, *extra])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_zo_plan_saves_plots_of_step_time(tmp_path, capsys):
    assert main([*ARGS_13B, "--plot", str(tmp_path)]) == 0
    for name in ("step_time_vs_batch.png", "step_time_vs_link.png"):
        assert (tmp_path / name).stat().st_size > 10_000


def test_zo_plan_calibrate_keeps_the_presets_capacities(capsys, monkeypatch):
    quick = perfmodel.calibrate
    monkeypatch.setattr(
        perfmodel, "calibrate", lambda base, **kw: quick(base, **kw, numel=1 << 18, repeats=1)
    )
    assert main(["plan", "--params", "13B", "--preset", "a100-80g", "--calibrate", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "a100-80g+calibrated: 8 GPU(s) of 85.9 GB" in out and "host 2199.0 GB, 128 cores" in out
    assert "stage 2 + optimizer offload            35.2 GB  260.0 GB  yes" in out  # 13B fits in 2 TiB


def test_zo_plan_calibrated_on_this_machine(capsys):
    args = ["plan", "--params", "10M", "--preset", "this-cpu", "--threads", "1", "--precision", "fp32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "this-cpu: 1 GPU(s)" in out or torch.cuda.is_available()
    assert "Recommendation:" in out
