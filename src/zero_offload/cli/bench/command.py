"""`zo bench` (`make bench`): its options, and the call into run.py, imported only when it runs."""

from __future__ import annotations

from ..arguments import parse_count
from .sections import SECTIONS as BENCH_SECTIONS

HELP = "benchmarks, reported as ratios from one run (out/bench/)"


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="out/bench")
    parser.add_argument("--numel", type=parse_count, default=16_700_000)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds; each times every variant")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--only",
        nargs="+",
        choices=BENCH_SECTIONS,
        default=BENCH_SECTIONS,
        metavar="SECTION",
        help=f"run only these sections ({', '.join(BENCH_SECTIONS)}); results.json keeps the others'",
    )


def run(args) -> int:
    from .run import run_bench

    run_bench(args.out, numel=args.numel, rounds=args.rounds, threads=args.threads, only=tuple(args.only))
    return 0
