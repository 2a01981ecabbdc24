"""The measurement probes of module 4 (zero_offload.tuning.bandwidth): plain numbers, quickly, on any machine.

Sizes are small so that each probe runs in a fraction of a second; the values are checked for sense, not speed
(timing assertions belong to the acceptance test in test_perfmodel.py, which compares two measurements).
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from zero_offload.tuning import bandwidth
from zero_offload.tuning.build import CompilerNotFound

HAS_COMPILER = any(shutil.which(cc) for cc in ("cc", "gcc", "clang"))
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on this machine")


def test_median_seconds_runs_the_hook_before_every_timed_call():
    calls = []
    seconds = bandwidth.median_seconds(
        lambda: calls.append("fn"), 3, warmup=1, before=lambda: calls.append("before")
    )
    assert calls == ["fn"] + ["before", "fn"] * 3
    assert seconds >= 0


def test_host_copy_bandwidth_is_a_plausible_number():
    result = bandwidth.host_copy_bandwidth(8 * 2**20, repeats=3)
    assert result.nbytes == 8 * 2**20
    assert 0.1 < result.gb_per_s < 10_000  # GB/s: from a slow laptop to HBM


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where CUDA is missing")
def test_link_bandwidth_without_cuda_says_what_to_use_instead():
    with pytest.raises(RuntimeError, match="CUDA.*host_copy_bandwidth"):
        bandwidth.device_link_bandwidth()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_and_pageable_link_bandwidth_on_cuda():
    link = bandwidth.device_link_bandwidth(16 * 2**20, repeats=3)
    for value in (link.h2d_pinned, link.h2d_pageable, link.d2h_pinned, link.d2h_pageable):
        assert 0.1 < value < 2_000
    assert link.pinned == min(link.h2d_pinned, link.d2h_pinned)
    assert link.pinned_speedup == pytest.approx(link.pinned / link.pageable)


@needs_compiler
@pytest.mark.parametrize("form", list(bandwidth.ADAM_FORMS))
def test_cpu_adam_profile_of_the_c_kernel(form):
    profile = bandwidth.cpu_adam_profile(threads=1, form=form, numel=1 << 20, repeats=2)
    assert (profile.impl, profile.form, profile.threads, profile.note) == ("C SIMD", form, 1, "")
    assert (
        1e6 < profile.params_per_s < 1e12 and 0 <= profile.call_seconds < 0.01 and profile.step_seconds >= 0
    )
    # the cost model the performance model uses: calls plus parameters at the throughput
    expected = profile.step_seconds + 3 * profile.call_seconds + 5e6 / profile.params_per_s
    assert profile.seconds(5e6, calls=3) == pytest.approx(expected)


def test_torch_fused_adam_for_reference():
    profile = bandwidth.cpu_adam_profile(threads=1, numel=1 << 18, repeats=2, impl="torch")
    assert profile.impl == "torch fused" and profile.form == "fp32" and profile.params_per_s > 1e6


def test_without_a_compiler_the_profile_measures_torch_and_says_so(monkeypatch):
    def no_compiler():
        raise CompilerNotFound("no C compiler found (test)")

    monkeypatch.setattr(bandwidth, "build", no_compiler)
    profile = bandwidth.cpu_adam_profile(threads=1, form="fp16", numel=1 << 18, repeats=2)
    assert profile.impl == "torch fused" and profile.form == "fp32"
    assert "instead of the C kernel" in profile.note and "fp32 gradients only" in profile.note
    assert profile.params_per_s > 1e6


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
    assert all(p.params_per_s > 0 and math.isfinite(p.params_per_s) for p in profiles)


def test_matmul_speed_on_the_cpu():
    assert 1e-5 < bandwidth.matmul_tflops("cpu", size=128, repeats=2) < 1_000
