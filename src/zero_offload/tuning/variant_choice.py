"""Which loop of the C Adam `"variant": "fastest"` runs: each one this CPU supports, timed once, the fastest kept.

Wider is not always faster. The step is bound by memory bandwidth, and on some CPUs (a Zen 5 VM was one) the
512-bit loop loses: its clock drops, or its loads queue behind the same memory as the 256-bit one's.
So the choice is measured, not assumed.

The moments' precision is part of the question. With fp32 moments the loops wait on memory; with bf16 or int8
moments they move fewer bytes and do more work a byte (decode, encode), so the wider loop can win where it lost
with fp32, or lose where it won (the choices of an Intel Xeon with AVX-512, per precision and thread count, are
in course/measured/bench-adam-intel-xeon.txt).

The sample is sized past the last-level cache (a 300 MiB L3 holds a 4M-element pass whole, and flatters the
wider loop), and the variants take turns, one pass each per round, so that a busy spell slows all of them alike.

Measured once per machine: the answer is cached in a file (beside the compiled kernel, `ZO_CACHE_DIR`) keyed by
the CPU, the kernel's build, the thread count and the moments' precision, and a file lock makes the first process measure while the
others wait and read its answer. Every process and every rank of a machine thus runs the same loop, and the
numbers of two runs do not differ by a timing accident. `"variant": "avx2"` (or any other) still forces one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .build import build, cache_dir
from .cpuinfo import cpu_caches, cpu_model

SAMPLE = 1 << 22  # at least 4M elements: 112 MB a pass with fp32 moments ...
LARGEST_SAMPLE = 1 << 25  # ... and at most 32M (1 GB of buffers), however large the cache
REPEATS = 5  # rounds; each variant's best pass is kept: a busy moment slows one pass, not the minimum
CACHE_FILE = "cpu_adam_variant.json"


def choice_key(threads: int, precision: str = "fp32") -> str:
    """What the choice depends on: the CPU, the kernel's build (its module name carries the source's hash),
    how many threads share the memory bandwidth, the moments' precision (which loops run), and the sample (a
    choice timed another way is timed again)."""
    return f"{cpu_model()} | {build().__name__} | {threads} thread(s) | {precision} moments | sample {sample_size():,}"


def sample_size(last_level_cache: int | None = None) -> int:
    """Elements of the timed pass: enough that its buffers (16 bytes an element at the least, with int8
    moments) fill twice the last-level cache, so every variant waits on memory as the engine's step does."""
    cache = cpu_caches().last_level if last_level_cache is None else last_level_cache
    return max(SAMPLE, min(LARGEST_SAMPLE, 2 * (cache or 0) // 16))


def time_variants(variants: list[str], threads: int, precision: str = "fp32") -> dict[str, float]:
    """Milliseconds of one Adam pass over sample_size() elements with `precision` moments, for each variant:
    the best of REPEATS rounds, in which the variants take turns. fp32 moments get fp32 gradients; narrow ones
    the offloaded step's fp16 gradients in and fp16 weights out, the only way the engine runs them."""
    from .cpu_adam import cpu_adam_update  # imports this module: late
    from .state_precision import zeros_state

    numel = sample_size()
    param, grad = torch.rand(numel), torch.rand(numel)
    out = None
    if precision != "fp32":
        grad, out = grad.half(), torch.empty(numel, dtype=torch.float16)
    state = zeros_state(numel, precision)
    moments = {"exp_avg_scale": state.get("exp_avg_scale"), "exp_avg_sq_scale": state.get("exp_avg_sq_scale")}
    best = dict.fromkeys(variants, float("inf"))
    for step in range(1, REPEATS + 2):
        for variant in variants:
            start = time.perf_counter()
            cpu_adam_update(
                param, grad, state["exp_avg"], state["exp_avg_sq"], step=step, lr=1e-3, variant=variant,
                threads=threads, out=out, **moments,
            )  # fmt: skip
            if step > 1:  # the first round faults the pages in and warms the code: not counted
                best[variant] = min(best[variant], time.perf_counter() - start)
    return {variant: seconds * 1e3 for variant, seconds in best.items()}


def fastest_variant(
    threads: int,
    variants: list[str],
    precision: str = "fp32",
    *,
    measure: Callable[[list[str], int, str], dict[str, float]] = time_variants,
    directory: Path | None = None,
) -> str:
    """The fastest of `variants` at `threads` threads with `precision` moments on this machine: read from the
    cache, or measured (by `measure`) and written there. A cache that cannot be read or written costs a
    measurement, never an error."""
    path = (directory or cache_dir()) / CACHE_FILE
    key = choice_key(threads, precision)
    with _locked(path):
        cached = _read(path)
        entry = cached.get(key)
        if isinstance(entry, dict) and entry.get("variant") in variants:
            return entry["variant"]
        timings = measure(variants, threads, precision)
        chosen = min(timings, key=timings.get)
        cached[key] = {"variant": chosen, "ms": {v: round(ms, 3) for v, ms in timings.items()}}
        _write(path, cached)
        return chosen


def cached_choices(directory: Path | None = None) -> dict:
    """Every choice made on this machine so far, with the timings it was made from (for `zo bench`)."""
    return _read((directory or cache_dir()) / CACHE_FILE)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock beside `path`, so that one process measures while the others wait for its answer;
    without a writable directory, no lock (and each process measures for itself)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_suffix(".lock"), "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or damaged: measure again
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict) -> None:
    temporary = path.with_suffix(f".tmp{os.getpid()}")
    try:
        temporary.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(temporary, path)  # readers see the old file or the new one, never half of one
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink()
