"""Two or more versions of the C kernel, timed side by side: the one-pass step with the moments in one precision.

`make bench` times one kernel. A change worth a few percent hides between two of its runs, because a VM's memory
bandwidth can change from one run to the next (chapter 4.6). Here every kernel runs in the same rounds as the
fp32 step and that precision's memory floor, timed as `make bench` times them: each round calls each function
three times in a row and keeps the median (so a function is not charged with the previous one's dirty cache
lines), and the report gives the median over rounds. Each kernel's own state, weights and step counter advance
as in training, in arrays placed as the engine places its host states (cli/bench/adam.py's host_zeros). Every
kernel is built with this checkout's cpu_adam.h, so a revision whose header differs is refused.

    python -m tools.ab_cpu_adam 093041a HEAD [--precision int8] [--threads 1 2] [--rounds 10]

A revision is anything `git show` takes, or the path of a cpu_adam.c file. The fp32 step and the floor are this
checkout's.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import tempfile
from pathlib import Path
from unittest import mock

import torch

from tools.ab_options import add_step_options
from zero_offload.cli.bench.adam import host_state, host_zeros, state_floor, state_step, streaming_stores
from zero_offload.cli.bench.timing import interleaved_ms
from zero_offload.tuning import build as kernel_build
from zero_offload.tuning import cpu_adam
from zero_offload.tuning.cpuinfo import cpu_model
from zero_offload.tuning.state_precision import PRECISIONS

ROOT = Path(__file__).resolve().parent.parent
IN_REPO = "src/zero_offload/tuning/csrc/"


def kernel_source(revision: str, directory: Path) -> Path:
    """The cpu_adam.c of `revision` (a git revision or a file), as a file; refuses a revision whose header differs."""
    if Path(revision).is_file():
        return Path(revision)

    def show(name: str) -> bytes:
        shown = subprocess.run(["git", "show", f"{revision}:{IN_REPO}{name}"], cwd=ROOT, capture_output=True)
        if shown.returncode != 0:
            raise SystemExit(
                f"{revision}: not a file, and git cannot show its {name}: {shown.stderr.decode().strip()}"
            )
        return shown.stdout

    if show("cpu_adam.h") != kernel_build.HEADER.read_bytes():
        raise SystemExit(
            f"{revision}: its cpu_adam.h differs from this checkout's, so the kernels cannot share one"
        )
    path = directory / f"{abs(hash(revision))}.c"
    path.write_bytes(show("cpu_adam.c"))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revisions", nargs="+", help="git revisions or cpu_adam.c files")
    parser.add_argument("--precision", choices=PRECISIONS, default="int8")
    add_step_options(parser, rounds=10)
    args = parser.parse_args(argv)
    streaming = streaming_stores()  # the floor's fp16 output as the kernel writes it, where the CPU can

    n = args.numel
    grad = host_zeros(n, torch.float16).copy_(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    out = host_zeros(n, torch.float16)
    with tempfile.TemporaryDirectory() as directory:
        modules = {
            _label(revision): kernel_build.build(kernel_source(revision, Path(directory)), name=f"zo_ab_{k}")
            for k, revision in enumerate(args.revisions)
        }
    ours = kernel_build.build()
    fns = {}
    for threads in args.threads:
        # The fp32 step and the floor with this checkout's kernel; each revision's step with its own.
        fp32 = state_step(
            host_zeros(n), grad, host_state(n, "fp32"), out, threads, args.variant, itertools.count(1)
        )
        fns[("fp32 step", threads)] = lambda fn=fp32: _with(ours, fn)
        floor = state_floor(host_zeros(n), grad, host_state(n, args.precision), out, threads, streaming)
        fns[(f"{args.precision} floor", threads)] = lambda fn=floor: _with(ours, fn)
        for revision, module in modules.items():
            state = host_state(n, args.precision)
            step = state_step(host_zeros(n), grad, state, out, threads, args.variant, itertools.count(1))
            fns[(revision, threads)] = lambda fn=step, m=module: _with(m, fn)
    ms = interleaved_ms({f"{name} x{t}": fn for (name, t), fn in fns.items()}, args.rounds, desc="kernels")
    print(f"{args.precision} step over {n:,} parameters, variant {args.variant}, CPU: {cpu_model()}, "
          f"medians of {args.rounds} interleaved rounds")  # fmt: skip
    for threads in args.threads:
        fp32, floor = ms[f"fp32 step x{threads}"], ms[f"{args.precision} floor x{threads}"]
        print(
            f"x{threads}: fp32 step {fp32:.2f} ms, {args.precision} floor {floor:.2f} ms"
            + (" (streaming output)" if streaming else "")
        )
        for revision in modules:
            took = ms[f"{revision} x{threads}"]
            print(
                f"   {revision:<24} {took:6.2f} ms   of floor {floor / took:4.0%}   vs fp32 {fp32 / took:.2f}x"
            )
    return 0


def _label(revision: str) -> str:
    """A git revision as its short hash (HEAD moves), a file as its path."""
    if Path(revision).is_file():
        return revision
    named = subprocess.run(
        ["git", "rev-parse", "--short", revision], cwd=ROOT, capture_output=True, text=True
    )
    return named.stdout.strip() or revision


def _with(module, fn):
    with mock.patch.object(cpu_adam, "build", lambda: module):
        fn()


if __name__ == "__main__":
    raise SystemExit(main())
