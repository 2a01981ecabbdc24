"""The SIMD primer's example (course/examples/simd_primer.c) compiles with no -m flag, checks itself against a
plain loop, and reports the mistake it can be built with (no scalar tail)."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "course" / "examples" / "simd_primer.c"
COMPILER = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C compiler (cc or gcc) on PATH")


def _build_and_run(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    binary = tmp_path / "simd_primer"
    subprocess.run([COMPILER, "-O2", "-Wall", "-Werror", *flags, "-o", str(binary), str(EXAMPLE)], check=True)
    return subprocess.run([str(binary)], capture_output=True, text=True, timeout=30)


def _has_avx2(run: subprocess.CompletedProcess) -> bool:
    return "saxpy" in run.stdout


def test_the_example_matches_the_plain_loop_and_rounds_to_nearest_even(tmp_path):
    run = _build_and_run(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    if platform.machine() not in ("x86_64", "AMD64") or not _has_avx2(run):
        pytest.skip(f"no AVX2/FMA/F16C here: {run.stdout.strip()}")
    for n in (0, 1, 7, 8, 9, 1003):
        assert f"saxpy n={n}: OK" in run.stdout
    # The ties the chapter explains, overflow past 65504 and underflow.
    for line in ("-> 0x3c00 -> 1\n", "-> 0x3c02 -> 1.00195312", "-> 0x7c00 -> inf", "-> 0x0000 -> 0"):
        assert line in run.stdout


def test_without_the_scalar_tail_it_names_the_first_element_left_out(tmp_path):
    run = _build_and_run(tmp_path, "-DPRIMER_BROKEN_TAIL")
    if not _has_avx2(run):
        pytest.skip(f"no AVX2/FMA/F16C here: {run.stdout.strip()}")
    assert run.returncode == 1
    assert "saxpy n=8: OK" in run.stdout  # a multiple of 8 needs no tail
    assert "saxpy n=9: element 8 is" in run.stdout and "saxpy n=1003: element 1000 is" in run.stdout
