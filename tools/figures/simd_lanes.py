"""Chapter 4A's figure, drawn from stated arithmetic (no measurement):

- simd-lanes.png: `saxpy_avx2` of course/examples/simd_primer.c over n = 1003 floats (the primer's longest
                  example). Top: the array cut into AVX2 iterations, which run while `i + 8 <= n`, and the scalar
                  tail of n mod 8 elements. Middle: one iteration's registers, 256 bits = 8 fp32 lanes of 32 bits,
                  and `_mm256_fmadd_ps(a, x, y)` lane by lane. Bottom: the F16C round trip, 8 fp32 lanes
                  (256 bits) to 8 fp16 lanes in a 128-bit register and back.

Every number on the figure (lanes, iterations, tail, bits) is computed below from n and the register width.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from matplotlib.patches import FancyArrowPatch, Rectangle

from .style import CPU, CPU_LIGHT, EDGE, GPU_LIGHT, HOLLOW, INK, LINK, LINK_LIGHT, canvas, save

N = 1003  # the primer's example: saxpy n=1003 in course/examples/simd_primer.c
REGISTER_BITS = 256  # AVX2's __m256
FP32_BITS = 32
FP16_BITS = 16


@dataclass(frozen=True)
class Split:
    n: int
    lanes: int  # floats in one register
    iterations: int  # vector iterations of the main loop
    tail: int  # elements left to the scalar loop

    @property
    def tail_start(self) -> int:
        """Where the main loop stops: the first element the tail does."""
        return self.iterations * self.lanes

    @property
    def starts(self) -> tuple[int, ...]:
        """i at the top of each vector iteration."""
        return tuple(range(0, self.tail_start, self.lanes))


def lanes(register_bits: int = REGISTER_BITS, element_bits: int = FP32_BITS) -> int:
    return register_bits // element_bits


def split(n: int, register_bits: int = REGISTER_BITS) -> Split:
    """The primer's loop, counted as it runs: `for (; i + w <= n; i += w)`, then the tail from i to n."""
    w = lanes(register_bits)
    i = iterations = 0
    while i + w <= n:
        i += w
        iterations += 1
    return Split(n=n, lanes=w, iterations=iterations, tail=n - i)


def f16c_bits(register_bits: int = REGISTER_BITS) -> int:
    """The register `_mm256_cvtps_ph` writes: one fp16 per fp32 lane of the input."""
    return lanes(register_bits) * FP16_BITS


def _cells(ax, x: float, y: float, width: float, height: float, texts, color: str, fontsize: float = 7.5):
    """A row of equal cells, one per text, left to right."""
    for k, text in enumerate(texts):
        ax.add_patch(
            Rectangle((x + k * width, y), width, height, facecolor=color, edgecolor=EDGE, linewidth=0.7)
        )
        ax.text(x + (k + 0.5) * width, y + height / 2, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, start, end):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=10, color=INK, linewidth=1))


def _array_row(ax, s: Split, top: float) -> None:
    """The array: the first iterations, an ellipsis, the last two, and the tail."""
    cell, h, x0 = 0.17, 0.3, 0.5
    shown_first = s.starts[:3]
    shown_last = s.starts[3:][-2:]
    x = x0
    y = top - 0.75
    ax.text(
        x0,
        top,
        f"saxpy_avx2 over n = {s.n} floats: {s.iterations} AVX2 iterations while i + {s.lanes} <= n "
        f"({s.iterations} x {s.lanes} = {s.tail_start} elements), then a scalar tail of "
        f"{s.n} mod {s.lanes} = {s.tail}",
        fontsize=10,
        va="top",
        color=INK,
    )

    def group(i: int, x: float) -> float:
        _cells(ax, x, y, cell, h, [""] * s.lanes, CPU_LIGHT)
        ax.add_patch(Rectangle((x, y), cell * s.lanes, h, fill=False, edgecolor=CPU, linewidth=1.6))
        ax.text(x + cell * s.lanes / 2, y - 0.08, f"i = {i}", ha="center", va="top", fontsize=8)
        return x + cell * s.lanes + 0.08

    for i in shown_first:
        x = group(i, x)
    if shown_last:
        skipped = s.iterations - len(shown_first) - len(shown_last)
        ax.text(x + 0.55, y + h / 2, f"... {skipped} more ...", ha="center", va="center", fontsize=8)
        x += 1.1
        for i in shown_last:
            x = group(i, x)
    if s.tail:
        _cells(ax, x, y, cell * 2.6, h, [str(s.tail_start + k) for k in range(s.tail)], LINK_LIGHT, 7)
        ax.add_patch(Rectangle((x, y), cell * 2.6 * s.tail, h, fill=False, edgecolor=LINK, linewidth=1.6))
        ax.text(
            x + cell * 2.6 * s.tail / 2,
            y - 0.08,
            f"scalar tail: {s.tail} (i = {s.tail_start} to {s.n - 1})",
            ha="center",
            va="top",
            fontsize=8,
            color=LINK,
        )


def draw_simd_lanes(path: Path) -> Path:
    s = split(N)
    fig, ax = canvas(11, 7)
    _array_row(ax, s, top=6.8)

    # one iteration's registers: the last vector iteration, lane by lane
    i = s.starts[-1]
    lane_w, h, x0, label_x = 0.8, 0.36, 2.95, 0.3
    bits = FP32_BITS
    ax.text(
        label_x,
        5.35,
        f"one iteration (i = {i}): a __m256 register is {REGISTER_BITS} bits = {s.lanes} fp32 lanes of "
        f"{bits} bits; one instruction works on all {s.lanes}",
        fontsize=10,
        va="top",
    )
    for k in range(s.lanes):
        ax.text(x0 + (k + 0.5) * lane_w, 4.92, f"lane {k}", ha="center", fontsize=8, color=EDGE)
    rows = [
        ("av = _mm256_set1_ps(a)", ["a"] * s.lanes, HOLLOW),
        (f"xv = _mm256_loadu_ps(x + {i})", [f"x[{i + k}]" for k in range(s.lanes)], CPU_LIGHT),
        (f"yv = _mm256_loadu_ps(y + {i})", [f"y[{i + k}]" for k in range(s.lanes)], CPU_LIGHT),
        (
            "yv = _mm256_fmadd_ps(av, xv, yv)",
            [f"a*x[{i + k}]\n+y[{i + k}]" for k in range(s.lanes)],
            GPU_LIGHT,
        ),
    ]
    y = 4.45
    for label, texts, color in rows:
        ax.text(x0 - 0.12, y + h / 2, label, ha="right", va="center", fontsize=8.5, family="monospace")
        _cells(ax, x0, y, lane_w, h, texts, color, fontsize=7 if "\n" in texts[0] else 7.5)
        y -= h + 0.14
    y += h + 0.14
    for k in range(s.lanes):
        ax.text(
            x0 + (k + 0.5) * lane_w,
            y - 0.06,
            f"bits {k * bits}-{(k + 1) * bits - 1}",
            ha="center",
            va="top",
            fontsize=7,
            color=EDGE,
        )
    right = x0 + s.lanes * lane_w
    ax.text(
        right + 0.15,
        y + h / 2,
        f"a*x+y per lane,\nrounded once (FMA);\nthen _mm256_storeu_ps\nwrites y[i..i+{s.lanes - 1}]",
        va="center",
        fontsize=8,
    )

    # the F16C round trip
    half_bits = f16c_bits()
    ax.text(
        label_x,
        2.05,
        f"F16C: {s.lanes} fp32 ({REGISTER_BITS} bits) -> {s.lanes} fp16 of {FP16_BITS} bits in a "
        f"{half_bits}-bit __m128i (16 bytes) and back",
        fontsize=10,
        va="top",
    )
    y32, y16 = 1.25, 0.3
    ax.text(
        x0 - 0.12, y32 + h / 2, "__m256, 8 x fp32", ha="right", va="center", fontsize=8.5, family="monospace"
    )
    _cells(ax, x0, y32, lane_w, h, [f"f{k}: 32 bits" for k in range(s.lanes)], CPU_LIGHT, 7)
    half_w = lane_w * FP16_BITS / FP32_BITS  # drawn to scale: half the bits, half the width
    ax.text(
        x0 - 0.12, y16 + h / 2, "__m128i, 8 x fp16", ha="right", va="center", fontsize=8.5, family="monospace"
    )
    _cells(ax, x0, y16, half_w, h, [f"h{k}" for k in range(s.lanes)], LINK_LIGHT, 7)
    _arrow(ax, (x0 + 0.4, y32 - 0.02), (x0 + 0.4, y16 + h + 0.02))
    ax.text(
        x0 + 0.5,
        y32 - 0.15,
        "_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT): rounds to nearest, ties to even",
        va="center",
        fontsize=8,
    )
    back_x, up_x = x0 + s.lanes * half_w, x0 + (s.lanes - 0.5) * lane_w
    ax.add_patch(
        FancyArrowPatch(
            (back_x + 0.02, y16 + h / 2),
            (up_x, y32 - 0.02),
            arrowstyle="-|>",
            mutation_scale=10,
            color=INK,
            linewidth=1,
            connectionstyle="angle,angleA=0,angleB=90,rad=0",
        )
    )
    ax.text(back_x + 0.15, y16 + h / 2 + 0.05, "_mm256_cvtph_ps: exact", va="bottom", fontsize=8)
    return save(fig, path)


FIGURES = {"simd-lanes.png": draw_simd_lanes}
