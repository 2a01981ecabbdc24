"""`make bench`: speed measured as ratios within one run (never as pass/fail timing in tests).

run_bench() runs the sections in the order of SECTIONS (sections.py) and keeps their results in results.json.
The sections live beside this file, by what they time: adam.py (the Adam kernel), training.py (whole training
steps), cpu.py (the CPU step against the performance model); timing.py says how.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...plots import plot_bars
from .adam import (
    BYTES_PER_PARAM,
    adam_implementations,
    moment_precisions,
    offload_update,
    print_adam_implementations,
    print_moment_precisions,
    print_offload_update,
)
from .sections import SECTIONS
from .timing import wait_until_quiet
from .training import module5_bench, offload_overhead, print_offload_overhead


def write_measured(out: Path, result: dict, text: str) -> tuple[Path, Path]:
    """A measurement tool's output (tools/measure_*.py): `result` as the .json `out`, its printed form `text`
    beside it as .txt, and `text` on standard output. Returns the two paths."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".txt").write_text(text)
    print(text, end="")
    return out, out.with_suffix(".txt")


def run_bench(
    out_dir: str | Path = "out/bench",
    *,
    numel: int = 16_700_000,
    rounds: int = 7,
    threads: int = 2,
    only: tuple[str, ...] = SECTIONS,
):
    """Every section of `make bench` (SECTIONS, in that order), or the `only` ones: a run of some sections
    replaces their results in results.json and keeps those of the others from earlier runs."""
    from .cpu import after_torch_op, model_vs_engine, print_after_torch_op, print_model_vs_engine

    if set(only) - set(SECTIONS):
        raise ValueError(f"bench sections are {', '.join(SECTIONS)}; got {', '.join(only)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    partial = set(only) != set(SECTIONS)
    results = json.loads(path.read_text(encoding="utf-8")) if partial and path.exists() else {}
    if "adam" in only:
        adam = results["adam"] = adam_implementations(numel, rounds, threads)
        print_adam_implementations(adam)
        floor = BYTES_PER_PARAM * numel / adam["floor_ms"] / 1e6 if adam["floor_ms"] else None
        plot_bars(
            {name: BYTES_PER_PARAM * numel / ms / 1e6 for name, ms in adam["median_ms"].items()},
            out / "adam_step.png",
            title=f"Adam step, {numel / 1e6:.1f}M fp32 params, {threads} threads: memory traffic",
            ylabel="GB/s (28 bytes a parameter)",
            line=("memory floor", floor) if floor else None,
        )
    if "update" in only:
        results["offload_update"] = offload_update(numel, rounds, threads)
        print_offload_update(results["offload_update"])
    if "states" in only:
        results["moment_precisions"] = moment_precisions(numel, rounds, threads)
        print_moment_precisions(results["moment_precisions"])
    if "overhead" in only:
        results["offload_overhead"] = offload_overhead()
        print_offload_overhead(results["offload_overhead"])
    if "model" in only:
        waited = wait_until_quiet()  # the model is calibrated in one moment and checked in the next
        results["model_vs_engine"] = {**model_vs_engine(), "waited_for_quiet_s": waited}
        print_model_vs_engine(results["model_vs_engine"])
    if "torch-op" in only:
        waited = wait_until_quiet()  # "quiet" means this process's own threads only
        results["after_torch_op"] = {**after_torch_op(numel, rounds, threads), "waited_for_quiet_s": waited}
        print_after_torch_op(results["after_torch_op"])
    if "module5" in only:
        results.update(module5_bench(out))
    path.write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(f"\nresults: {path}" + (f", plot: {out / 'adam_step.png'}" if "adam" in only else ""))
    return results
