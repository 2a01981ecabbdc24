"""The one-pass step and its memory floor with the host arrays on malloc's pages and on the engine's own, timed
side by side.

The engine puts every large host buffer on 2 MiB pages of its own, each starting at a different offset
(accelerator/host_allocator.py's `host_pages`). This tool shows what that placement is worth: it builds the
same arrays twice, once with torch's allocator (4 KiB pages, wherever malloc puts them) and once with
`host_pages`, and times the fp32 step, each precision's step and that precision's floor on both in the same
rounds, as `make bench` times them. Besides the medians it prints, for each function, the median over rounds
of its time on host pages divided by its time on malloc's pages in the same round: a slow spell of the VM
then divides out. Which physical pages a process gets is chance, so run it more than once.

    python -m tools.ab_host_pages [--precision int8 bf16] [--threads 1 2] [--rounds 20]
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from tools.ab_options import add_step_options
from zero_offload.cli.bench.adam import host_state, host_zeros, state_floor, state_step, streaming_stores
from zero_offload.cli.bench.timing import interleaved_rounds
from zero_offload.tuning.cpuinfo import cpu_model
from zero_offload.tuning.state_precision import PRECISIONS, zeros_state

PLACEMENTS = {
    "malloc": (lambda n, dtype=torch.float32: torch.zeros(n, dtype=dtype), zeros_state),
    "host pages": (host_zeros, host_state),
}


def placement_fns(placement: str, args, streaming: bool) -> dict[tuple, object]:
    """(function name, threads) -> the function, every array of them placed by `placement`."""
    zeros, state_of = PLACEMENTS[placement]
    n = args.numel
    grad = zeros(n, torch.float16).copy_(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    out = zeros(n, torch.float16)
    arrays = {"fp32": (zeros(n), state_of(n, "fp32"))}
    floors = {}
    for precision in args.precision:
        arrays.setdefault(precision, (zeros(n), state_of(n, precision)))
        floors[precision] = (zeros(n), state_of(n, precision))
    fns = {}
    for threads in args.threads:
        for precision, (param, state) in arrays.items():
            counter = itertools.count(1)
            fns[(f"{precision} step", threads)] = state_step(
                param, grad, state, out, threads, args.variant, counter
            )
        for precision, (param, state) in floors.items():
            fns[(f"{precision} floor", threads)] = state_floor(param, grad, state, out, threads, streaming)
    return fns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--precision", choices=[p for p in PRECISIONS if p != "fp32"], nargs="+", default=["int8"]
    )
    add_step_options(parser, rounds=20)
    args = parser.parse_args(argv)
    streaming = streaming_stores()
    fns = {}
    for placement in PLACEMENTS:
        for (name, threads), fn in placement_fns(placement, args, streaming).items():
            fns[f"{placement}: {name} x{threads}"] = fn
    rounds = interleaved_rounds(fns, args.rounds, desc="placements")
    ms = {name: statistics.median(times) for name, times in rounds.items()}
    print(
        f"One-pass step over {args.numel:,} parameters, variant {args.variant}, CPU: {cpu_model()}, medians of "
        f"{args.rounds} interleaved rounds\nmalloc: torch's allocator; host pages: accelerator/host_allocator.py's "
        "host_pages (2 MiB pages, staggered starts)" + ("; floors with streaming output" if streaming else "")
    )
    for threads in args.threads:
        for precision in args.precision:
            for placement in PLACEMENTS:
                fp32, step, floor = (
                    ms[f"{placement}: {name} x{threads}"]
                    for name in ("fp32 step", f"{precision} step", f"{precision} floor")
                )
                print(
                    f"x{threads} {precision:<5}{placement:<11} fp32 step {fp32:6.2f} ms  {precision} step {step:6.2f}"
                    f" ms  floor {floor:6.2f} ms  of floor {floor / step:4.0%}  vs fp32 {fp32 / step:.2f}x"
                )
            paired = "  ".join(
                f"{name} {_paired_ratio(rounds, name, threads):.3f}"
                for name in ("fp32 step", f"{precision} step", f"{precision} floor")
            )
            print(f"   host pages / malloc, median of per-round ratios: {paired}")
    return 0


def _paired_ratio(rounds: dict, name: str, threads: int) -> float:
    ours, malloc = rounds[f"host pages: {name} x{threads}"], rounds[f"malloc: {name} x{threads}"]
    return statistics.median(a / b for a, b in zip(ours, malloc, strict=True))


if __name__ == "__main__":
    raise SystemExit(main())
