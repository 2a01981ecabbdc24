"""The SIMD primer's figure computes its numbers from n and the register width: they must be the loop's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools.figures import simd_lanes

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("n", "iterations", "tail"),
    [(1003, 125, 3), (9, 1, 1), (7, 0, 7), (8, 1, 0), (1, 0, 1), (0, 0, 0)],
)
def test_the_main_loop_and_the_tail_of_the_primers_lengths(n, iterations, tail):
    s = simd_lanes.split(n)
    assert (s.lanes, s.iterations, s.tail) == (8, iterations, tail)
    assert s.tail == n % 8 and s.iterations == n // 8
    assert s.tail_start + s.tail == n
    assert len(s.starts) == s.iterations and all(i + 8 <= n for i in s.starts)


def test_the_figure_draws_the_primers_longest_example():
    source = (REPO / "course" / "examples" / "simd_primer.c").read_text(encoding="utf-8")
    lengths = re.search(r"const long lengths\[\] = \{([^}]*)\}", source)[1]
    assert simd_lanes.N == max(int(n) for n in lengths.split(",")) == 1003
    s = simd_lanes.split(simd_lanes.N)
    assert s.tail_start == 1000 and s.starts[-1] == 992


def test_register_widths():
    assert simd_lanes.lanes() == 8  # __m256: 256 / 32
    assert simd_lanes.lanes(512) == 16  # __m512
    assert simd_lanes.lanes(128) == 4  # SSE
    assert simd_lanes.f16c_bits() == 128  # 8 fp16 fill a __m128i
    assert simd_lanes.split(1003, register_bits=512).tail == 1003 % 16
