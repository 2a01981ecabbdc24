"""The hardware figures (tuning/hardware.py, module 4): the CPU Adam's throughput per host, per rank and per
thread, and calibration on this machine, which gives sane figures whatever its speed."""

from __future__ import annotations

import math
import shutil
from dataclasses import replace

import pytest
import torch

from zero_offload.tuning import bandwidth, cpuinfo, hardware
from zero_offload.tuning.advisor import recommend
from zero_offload.tuning.perfmodel import PRESETS, Workload, calibrate, plan
from zero_offload.tuning.plan_report import describe

B = 10**9
ONE_A100 = replace(PRESETS["a100-80g"], gpus=1, gpu_memory=80 * B, host_memory=256 * B)
THIRTEEN_B = Workload(13 * B)
MiB = 2**20


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
