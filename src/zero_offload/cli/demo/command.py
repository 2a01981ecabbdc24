"""`zo demo` (`make demo`): its options, and the call into run.py, imported only when it runs."""

from __future__ import annotations

import argparse

HELP = "the instructor's end-to-end demo (writes out/demo/report.md)"


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="out/demo")
    parser.add_argument("--ranks", type=int, default=2, help="processes, launched with torchrun on loopback")
    parser.add_argument("--budget", default="512MiB", help="the emulated device's memory, e.g. 512MiB")
    parser.add_argument("--steps", type=int, default=20, help="training steps of part 2")
    parser.add_argument("--quick", action="store_true", help="small models and budget: a check that it runs")
    parser.add_argument("--ranks-only", action="store_true", help=argparse.SUPPRESS)  # the launcher's ranks


def run(args) -> int:
    from .run import run_demo

    run_demo(
        args.out,
        ranks=args.ranks,
        budget=args.budget,
        steps=args.steps,
        quick=args.quick,
        ranks_only=args.ranks_only,
    )
    return 0
