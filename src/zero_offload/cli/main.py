"""The `zo` command: one subcommand per module, each holding its own options beside the code that runs them.

    demo          demo/command.py        the instructor's demo (`make demo`)
    estimate      estimate.py            model-state bytes per tier
    plan          plan.py                the performance model's verdict and advice
    train         train/command.py       the training application
    bench         bench/command.py       benchmarks (`make bench`)
    grade         grade/run.py           a lab's grade (`make labN`)
    check-config  check_config.py        a config, read as the engine reads it
    checkpoint    checkpoint.py          a checkpoint's fp32 weights for plain PyTorch

Each offers its help line, `add_arguments(parser)` and `run(args)`, which returns the exit status and imports
what the command needs only when it runs: `zo --help` starts no training code.
"""

from __future__ import annotations

import argparse

from . import check_config, checkpoint, estimate, plan
from .bench import command as bench
from .demo import command as demo
from .grade import run as grade
from .train import command as train

COMMANDS = {
    "demo": demo,
    "estimate": estimate,
    "plan": plan,
    "train": train,
    "bench": bench,
    "grade": grade,
    "check-config": check_config,
    "checkpoint": checkpoint,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zo", description="zero-offload: the course's engine and tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command].run(args)
