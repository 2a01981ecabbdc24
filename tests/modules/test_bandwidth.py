"""The measurement probes of module 4 (zero_offload.tuning.bandwidth, adam_probe, cache_probe): plain numbers,
quickly, on any machine.

Sizes are small so that each probe runs in a fraction of a second; the values are checked for sense (finite,
positive, consistent with each other), never for speed: `make bench` reports speeds, no test asserts one.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from zero_offload.tuning import adam_probe, bandwidth
from zero_offload.tuning.build import CompilerNotFound

HAS_COMPILER = any(shutil.which(cc) for cc in ("cc", "gcc", "clang"))
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on this machine")


def _finite_positive(*values) -> bool:
    return all(math.isfinite(v) and v > 0 for v in values)


def test_median_seconds_runs_the_hook_before_every_timed_call():
    calls = []
    seconds = bandwidth.median_seconds(
        lambda: calls.append("fn"), 3, warmup=1, before=lambda: calls.append("before")
    )
    assert calls == ["fn"] + ["before", "fn"] * 3
    assert seconds >= 0


def test_host_copy_bandwidth_is_a_plausible_number():
    before = torch.get_num_threads()
    result = bandwidth.host_copy_bandwidth(8 * 2**20, repeats=3, threads=before + 1)
    assert result.nbytes == 8 * 2**20 and torch.get_num_threads() == before
    assert _finite_positive(result.gb_per_s)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where CUDA is missing")
def test_link_bandwidth_without_cuda_says_what_to_use_instead():
    with pytest.raises(RuntimeError, match="CUDA.*host_copy_bandwidth"):
        bandwidth.device_link_bandwidth()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_and_pageable_link_bandwidth_on_cuda():
    link = bandwidth.device_link_bandwidth(16 * 2**20, repeats=3)
    assert _finite_positive(link.h2d_pinned, link.h2d_pageable, link.d2h_pinned, link.d2h_pageable)
    assert link.pinned == min(link.h2d_pinned, link.d2h_pinned)
    assert link.pinned_speedup == pytest.approx(link.pinned / link.pageable)


@needs_compiler
@pytest.mark.parametrize("form", list(bandwidth.ADAM_FORMS))
def test_cpu_adam_profile_of_the_c_kernel(form):
    profile = bandwidth.cpu_adam_profile(threads=1, form=form, numel=1 << 20, repeats=2)
    assert (profile.impl, profile.form, profile.threads, profile.note) == ("C SIMD", form, 1, "")
    assert _finite_positive(profile.params_per_s) and profile.call_seconds >= 0 and profile.step_seconds >= 0
    assert math.isfinite(profile.call_seconds) and math.isfinite(profile.step_seconds)
    # the cost model the performance model uses: calls plus parameters at the throughput
    expected = profile.step_seconds + 3 * profile.call_seconds + 5e6 / profile.params_per_s
    assert profile.seconds(5e6, calls=3) == pytest.approx(expected)
    # never faster than the memory floor timed at the same threads allows
    assert _finite_positive(profile.floor_gb_per_s)
    assert profile.params_per_s <= profile.floor_gb_per_s * 1e9 / bandwidth.FORM_BYTES[form] * (1 + 1e-9)


def test_the_fit_recovers_step_call_and_throughput():
    numel, step, call, rate = 4_000_000, 2e-3, 50e-6, 4e8
    few, many, double = (
        step + calls * call + n / rate for calls, n in ((4, numel), (64, numel), (4, 2 * numel))
    )
    fitted = bandwidth.fit_adam_cost(numel, few, many, double, floor=numel / 8e8)
    assert fitted == pytest.approx((rate, call, step))


@pytest.mark.parametrize("form", ["fp32", "mixed"])
def test_noise_cannot_make_the_fit_faster_than_the_memory_floor(form):
    # The double pass hit by luck, the first one by a burst of noise: the difference says 4x the true speed.
    numel, floor = 4_000_000, 4_000_000 / 5e8  # the floor moves 5e8 parameters' bytes a second
    few, many, double = 10e-3, 10e-3 + 60 * 30e-6, 12.5e-3
    rate, call, step = bandwidth.fit_adam_cost(numel, few, many, double, floor, form)
    assert rate == pytest.approx(5e8 * bandwidth.FLOOR_BYTES / bandwidth.FORM_BYTES[form])
    assert call == pytest.approx(30e-6) and step == pytest.approx(few - 4 * call - numel / rate)
    # and no negative step cost: the elements take at most what the first pass left after its calls
    rate, call, step = bandwidth.fit_adam_cost(numel, few, many, 40e-3, floor)
    assert step == 0 and rate == pytest.approx(numel / (few - 4 * call))
    rate, _, _ = bandwidth.fit_adam_cost(numel, few, many, few - 1e-3)  # no floor and a negative difference
    assert rate == pytest.approx(numel / (few - 4 * call))


def test_torch_fused_adam_for_reference():
    profile = bandwidth.cpu_adam_profile(threads=1, numel=1 << 18, repeats=2, impl="torch")
    assert profile.impl == "torch fused" and profile.form == "fp32" and _finite_positive(profile.params_per_s)


def test_without_a_compiler_the_profile_measures_torch_and_says_so(monkeypatch):
    def no_compiler():
        raise CompilerNotFound("no C compiler found (test)")

    monkeypatch.setattr(adam_probe, "build", no_compiler)
    profile = bandwidth.cpu_adam_profile(threads=1, form="fp16", numel=1 << 18, repeats=2)
    assert profile.impl == "torch fused" and profile.form == "fp32"
    assert "instead of the C kernel" in profile.note and "fp32 gradients only" in profile.note
    assert _finite_positive(profile.params_per_s)


def test_a_probe_restores_torchs_thread_count():
    before = torch.get_num_threads()
    bandwidth.cpu_adam_profile(threads=before + 1, numel=1 << 16, repeats=1, impl="torch")
    assert torch.get_num_threads() == before


def test_bad_arguments_name_the_choices():
    with pytest.raises(ValueError, match="fp32, fp16, mixed"):
        bandwidth.cpu_adam_profile(form="fp8")
    with pytest.raises(ValueError, match="'auto' or 'torch'"):
        bandwidth.cpu_adam_profile(impl="numpy")


@needs_compiler
def test_thread_sweep_covers_every_thread_count_and_form():
    profiles = bandwidth.cpu_adam_sweep(2, forms=("fp16",), numel=1 << 18, repeats=1)
    seen = [(p.impl, p.form, p.threads) for p in profiles]
    assert seen == [
        ("C SIMD", "fp16", 1),
        ("torch fused", "fp32", 1),
        ("C SIMD", "fp16", 2),
        ("torch fused", "fp32", 2),
    ]
    assert all(_finite_positive(p.params_per_s) for p in profiles)


def test_matmul_speed_on_the_cpu():
    assert _finite_positive(bandwidth.matmul_tflops("cpu", size=128, repeats=2))


@needs_compiler
def test_the_cache_profile_of_the_c_kernel():
    memory = bandwidth.cpu_adam_profile(threads=1, numel=1 << 20, repeats=2)
    cache = bandwidth.cache_profile(memory, last_level=4 * 2**20, repeats=1)  # probes of 256 KiB to 8 MiB
    assert [size for size, _ in cache.probes] == [2**18 * 2**k for k in range(6)]
    assert _finite_positive(cache.cached_params_per_s, *(rate for _, rate in cache.probes))
    # the cache's speed is the fastest seen, never slower than memory's; it keeps some bytes, or none
    assert cache.cached_params_per_s == max(memory.params_per_s, *(rate for _, rate in cache.probes))
    assert cache.cache_bytes == 0 or 0 < cache.cache_bytes <= 2 * 8 * 2**20


def test_the_flush_is_larger_than_the_last_level_cache():
    last_level = adam_probe.cpu_caches().last_level
    assert 128 * 2**20 <= bandwidth.FLUSH_BYTES <= 2**30
    if last_level and last_level <= 2**29:
        assert bandwidth.FLUSH_BYTES >= 2 * last_level
