"""Lesson 4, sections 1 and 2: the C Adam kernel measured and checked from Python.

The roofline sweep calls the C function through cffi directly, so that a timing holds the kernel and not the
Python-side argument checks; the checks compare the kernel with torch.optim, its tail with its vector loop and its
rounding with torch's casts, bit for bit.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from ..tuning import build, cpu_adam_update
from ..tuning.cpu_adam import supported_variants

VARIANT_ID = {"scalar": 0, "avx2": 1, "avx512": 2}  # the variant numbers zo_adam_update takes (cpu_adam.h)
SWEEP_KINDS = {
    "C scalar": dict(variant="scalar"),
    "C avx2": dict(variant="avx2"),
    "memory floor": dict(floor=True),
}


def raw_kernel(kernel, n: int, variant: str = "avx2", threads: int = 1, floor: bool = False):
    """A zero-argument call of the C function on its own fresh fp32 buffers (no Python checks on the timed path)."""
    ffi, lib = kernel.ffi, kernel.lib
    w, g, m, v = torch.zeros(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    args = ffi.new("zo_adam_args *")
    args.param, args.exp_avg, args.exp_avg_sq = (ffi.cast("float *", t.data_ptr()) for t in (w, m, v))
    args.grad, args.out, args.n = ffi.cast("void *", g.data_ptr()), ffi.NULL, n
    args.grad_dtype = args.out_dtype = args.adamw = 0  # fp32 gradients, no 16-bit output, Adam with L2 decay
    args.beta1, args.one_minus_beta1, args.beta2, args.one_minus_beta2 = 0.9, 0.1, 0.999, 0.001
    args.eps, args.weight_decay, args.decay, args.grad_scale = 1e-8, 0.0, 1.0, 1.0
    args.step_size, args.bias_correction2_sqrt = 1e-3 / (1 - 0.9), math.sqrt(1 - 0.999)  # step 1
    keep = (w, g, m, v, args)  # the closure keeps the buffers alive: cffi holds only raw pointers
    if floor:
        return lambda keep=keep: lib.zo_memory_floor(keep[-1], threads, 0)
    return lambda keep=keep: lib.zo_adam_update(keep[-1], VARIANT_ID[variant], threads)


def roofline_sweep(
    kernel, sizes: list[int], *, elements: int, rounds: int, kinds: dict = SWEEP_KINDS
) -> dict:
    """GB/s (at 28 bytes a parameter) of each kind at each size: {(kind, n): GB/s}, medians over `rounds`.

    Small arrays are called many times (about `elements` elements a timing), so that each timing is long enough
    to trust; every round visits every (kind, size), so a busy spell on the machine hits all of them alike."""
    calls = {(kind, n): raw_kernel(kernel, n, **kw) for kind, kw in kinds.items() for n in sizes}
    times = {key: [] for key in calls}
    for _ in range(rounds):
        for (kind, n), fn in calls.items():
            repeat = max(1, elements // n)
            fn()  # warm: first touch of the pages and of the code
            started = time.perf_counter()
            for _ in range(repeat):
                fn()
            times[kind, n].append((time.perf_counter() - started) / repeat)
    return {key: 28 * key[1] / statistics.median(t) / 1e9 for key, t in times.items()}


def format_sweep(gbs: dict, sizes: list[int], kinds=SWEEP_KINDS) -> str:
    """The sweep as a table, and the in-cache against in-DRAM ratio of the AVX2 loop."""
    from ..units import format_bytes

    lines = [f"{'parameters':>11}{'working set':>13}" + "".join(f"{k + ' GB/s':>20}" for k in kinds)]
    for n in sizes:
        lines.append(f"{n:>11,}{format_bytes(16 * n):>13}" + "".join(f"{gbs[k, n]:>20.1f}" for k in kinds))
    in_cache = statistics.median(gbs["C avx2", n] for n in sizes if 16 * n <= 2**20)  # working set within L2
    in_dram = gbs["C avx2", sizes[-1]]
    scalar = statistics.median(gbs["C scalar", n] for n in sizes)
    lines.append(
        f"\nC avx2: {in_cache:.1f} GB/s with the working set in L2, {in_dram:.1f} GB/s at "
        f"{format_bytes(16 * sizes[-1])} ({in_cache / in_dram:.1f}x); C scalar: {scalar:.1f} GB/s at every size"
    )
    return "\n".join(lines)


def source_excerpt(first: str, last: str, lines: list[str] | None = None) -> list[str]:
    """The lines of cpu_adam.c from the first one containing `first` through the next one containing `last`."""
    lines = build.SOURCE.read_text().splitlines() if lines is None else lines
    start = next(i for i, line in enumerate(lines) if first in line)
    end = next(i for i in range(start, len(lines)) if last in lines[i])
    return lines[start : end + 1]


def run_ours(n, steps, *, adamw, variant, out_dtype=None, seed=0):
    """`steps` steps of the C Adam on seeded random gradients (scaled by 8, unscaled by grad_scale 1/8)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen)
        cpu_adam_update(
            w,
            g * 8,
            m,
            v,
            step=step,
            lr=1e-3,
            weight_decay=0.01,
            adamw=adamw,
            grad_scale=1 / 8,
            out=out,
            variant=variant,
            threads=1,
        )
    return w, out


def run_torch(n, steps, *, adamw, seed=0):
    """The same steps with torch.optim.Adam or AdamW: the reference."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=gen).requires_grad_()
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([w], lr=1e-3, weight_decay=0.01)
    for _ in range(steps):
        w.grad = torch.randn(n, generator=gen)
        opt.step()
    return w.detach()


def parity_report(n: int, steps: int) -> str:
    """Each variant against torch.optim (Adam and AdamW), and the vector loop against the scalar one."""
    lines = []
    for adamw in (False, True):
        reference = run_torch(n, steps, adamw=adamw)
        got = {
            variant: run_ours(n, steps, adamw=adamw, variant=variant)[0] for variant in supported_variants()
        }
        name, torch_name = ("AdamW", "AdamW") if adamw else ("Adam (L2)", "Adam")
        for variant, w in got.items():
            rel = float(torch.linalg.vector_norm(w - reference) / torch.linalg.vector_norm(reference))
            lines.append(
                f"{name:<10} {variant:<7} vs torch.optim.{torch_name}: relative error {rel:.1e}, "
                f"max |diff| {float((w - reference).abs().max()):.1e}"
            )
        if "avx2" in got:
            diff = got["avx2"] != got["scalar"]
            lines.append(
                f"{name:<10} avx2 vs scalar: {int(diff.sum()):,} of {n:,} weights differ, "
                f"max |diff| {float((got['avx2'] - got['scalar']).abs().max()):.1e} (FMA rounds once)\n"
            )
    return "\n".join(lines)


def tail_rows(lengths=(1, 7, 8, 9, 15, 16, 17, 1003), sentinel: float = 12345.0) -> list[tuple]:
    """(n, vector elements, tail elements, all updated, guard intact) for views of length n in longer buffers.

    The 8 elements after each view hold `sentinel`: a tail that runs past the end would change them."""
    variant = supported_variants()[-1]
    rows = []
    for n in lengths:
        buffers = [torch.full((n + 8,), sentinel) for _ in range(3)]
        w, m, v = (b[:n] for b in buffers)
        w.fill_(1.0)
        m.zero_()
        v.zero_()
        cpu_adam_update(w, torch.ones(n), m, v, step=1, lr=0.1, variant=variant, threads=1)
        vector = n // 8 * 8 if "avx2" in supported_variants() else 0
        intact = all(bool((b[n:] == sentinel).all()) for b in buffers)
        rows.append((n, vector, n - vector, bool((w != 1.0).all()), intact))
    return rows


# Ties, subnormals, overflow, infinities, a negative zero and a NaN: where a wrong rounding shows first.
EDGES = [
    1 + 2**-11,
    1 + 3 * 2**-11,
    1 + 2**-8,
    1 + 3 * 2**-8,
    -(1 + 2**-8),
    2049.0,
    2**-24,
    3 * 2**-25,
    2**-25,
    6.1e-5,
    65504.0,
    65519.0,
    65520.0,
    1e6,
    3e38,
    float("inf"),
    float("-inf"),
    -0.0,
    1e-40,
    float("nan"),
]


def rounding_rows(values: torch.Tensor) -> list[tuple[str, str, int, int]]:
    """(dtype, variant, bit-identical count, total): the kernel's 16-bit output with lr 0 against torch's casts."""
    rows = []
    for dtype, reference in ((torch.float16, values.half()), (torch.bfloat16, values.bfloat16())):
        for variant in supported_variants():
            n = values.numel()
            out = torch.empty(n, dtype=dtype)
            cpu_adam_update(
                values.clone(),
                torch.zeros(n),
                torch.zeros(n),
                torch.zeros(n),
                step=1,
                lr=0.0,
                out=out,
                variant=variant,
                threads=1,
            )
            both_nan = out.isnan() & reference.isnan()  # NaN payloads may differ: any NaN is right
            same_bits = out.view(torch.int16) == reference.view(torch.int16)
            rows.append(
                (str(dtype).removeprefix("torch."), variant, n - int((~(same_bits | both_nan)).sum()), n)
            )
    return rows


def compile_and_reload_seconds(name: str = "zo_cpu_adam_lesson") -> tuple[float, float]:
    """(seconds to compile into an empty cache, seconds for the same build() again), in a temporary cache.

    Another module name than the engine's: not loaded in this process yet, and not in the temporary cache."""
    previous = os.environ.get("ZO_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ZO_CACHE_DIR"] = tmp
        try:
            started = time.perf_counter()
            build.build(name=name)
            compile_s = time.perf_counter() - started
            started = time.perf_counter()
            build.build(name=name)
            again_s = time.perf_counter() - started
        finally:
            if previous is None:
                os.environ.pop("ZO_CACHE_DIR")
            else:
                os.environ["ZO_CACHE_DIR"] = previous
    return compile_s, again_s


# Bypasses the Python checks on purpose: the kernel is told N elements of buffers that hold 1000.
ASAN_SCRIPT = """
import math, sys, torch
from zero_offload.tuning.build import build
k = build(); ffi = k.ffi
N = int(sys.argv[1])
w, g, m, v = (torch.zeros(1000) for _ in range(4))
a = ffi.new("zo_adam_args *")
a.param, a.exp_avg, a.exp_avg_sq = (ffi.cast("float *", t.data_ptr()) for t in (w, m, v))
a.grad, a.out, a.n = ffi.cast("void *", g.data_ptr()), ffi.NULL, N
a.beta1, a.one_minus_beta1, a.beta2, a.one_minus_beta2, a.eps = 0.9, 0.1, 0.999, 0.001, 1e-8
a.step_size, a.bias_correction2_sqrt, a.grad_scale, a.decay = 1e-2, math.sqrt(1e-3), 1.0, 1.0
k.lib.zo_adam_update(a, -1, 1)
print("n =", N, "on 1000 elements: no report")
"""
ASAN_KEEP = ("no report", "ERROR: AddressSanitizer", " in adam_", "READ of size", "WRITE of size", "located")


def sanitizer_report(count: int, root: Path, keep_lines: int = 6) -> str:
    """Run ASAN_SCRIPT with `count` elements under ASan/UBSan in a child process; its exit code and key lines.

    Python is not built with ASan, so libasan is preloaded; ZO_CPU_ADAM_SANITIZE=1 selects the sanitized build."""
    libasan = subprocess.run(
        ["cc", "-print-file-name=libasan.so"], capture_output=True, text=True
    ).stdout.strip()
    env = dict(os.environ, LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0", ZO_CPU_ADAM_SANITIZE="1")
    run = subprocess.run(
        [sys.executable, "-c", ASAN_SCRIPT, str(count)], env=env, capture_output=True, text=True, timeout=300
    )
    report = [line.replace(str(root) + "/", "") for line in (run.stdout + run.stderr).splitlines()]
    keep = [line for line in report if any(mark in line for mark in ASAN_KEEP)]
    return f"n = {count}: exit code {run.returncode}\n" + textwrap.indent(
        "\n".join(keep[:keep_lines]), "    "
    )
