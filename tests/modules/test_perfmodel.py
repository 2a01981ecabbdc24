"""The performance model (tuning/perfmodel.py, module 4): bytes per tier, fit, step time and the CPU step's
structure. The advisor, the hardware figures and their calibration, and `zo plan` have test files of their own.

How close the calibrated prediction comes to the engine's measured CPU step is a timing, reported by
`make bench` (cli/bench/cpu.py, model_vs_engine), never asserted here: these tests check the model's structure."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zero_offload.basics.memory import estimate_model_states
from zero_offload.tuning.advisor import recommend, smallest_ratio
from zero_offload.tuning.partial import estimate_partial_offload
from zero_offload.tuning.perfmodel import (
    PRESETS,
    Workload,
    cached_share,
    cpu_adam_seconds,
    hardware_preset,
    plan,
    plan_all,
)
from zero_offload.tuning.plan_report import engine_only_keys, format_recommendation

B = 10**9
ONE_A100 = replace(PRESETS["a100-80g"], gpus=1, gpu_memory=80 * B, host_memory=256 * B)
THIRTEEN_B = Workload(13 * B)


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


# -- module 4's narrow moments: fewer host bytes, fewer bytes a CPU step moves ------------------------------------
@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_narrow_moments_shrink_the_hosts_states_and_the_cpu_step_by_their_bytes(moments):
    wl, narrow = Workload(13 * B), Workload(13 * B, moments=moments)
    for stage, offload in ((2, "optimizer"), (3, "optimizer+param")):
        wide, small = plan(ONE_A100, wl, stage, offload), plan(ONE_A100, narrow, stage, offload)
        expected = estimate_model_states(wl.params, stage=stage, offload_optimizer="cpu", moments=moments,
                                         offload_param="cpu" if offload == "optimizer+param" else "none")  # fmt: skip
        assert small.states.bytes == expected.bytes
        assert small.states.device == wide.states.device  # the device keeps what it kept
        # The pass from memory moves 28 bytes a parameter with fp32 moments (30 with the 16-bit copy): bf16
        # takes 8 off it, int8 12 less 16/2048 for the scales.
        saved = {"bf16": 8, "int8": 12 - 16 / 2048}[moments]
        assert small.time.cpu_adam < wide.time.cpu_adam
    cold = replace(ONE_A100, cpu_adam_cache_bytes=0)
    wide_s = cpu_adam_seconds(cold, 1e9, 0, "fp16")
    narrow_s = cpu_adam_seconds(cold, 1e9, 0, "fp16", moments)
    assert narrow_s == pytest.approx(wide_s * (30 - saved) / 30, rel=1e-12)
    # Device-only plans have no host moments to narrow.
    assert plan(ONE_A100, narrow, 2, "none").states.bytes == plan(ONE_A100, wl, 2, "none").states.bytes


def test_an_unknown_moment_precision_is_refused():
    with pytest.raises(ValueError, match="moments must be one of fp32, bf16, int8"):
        Workload(B, moments="int4")
