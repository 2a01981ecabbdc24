"""The options the side-by-side timing tools share (ab_cpu_adam.py, ab_host_pages.py): what to time and how long."""

from __future__ import annotations

from zero_offload.tuning import cpu_adam


def add_step_options(parser, *, rounds: int) -> None:
    """--threads, --rounds (default `rounds`), --numel and --variant (default: the widest this CPU runs)."""
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--numel", type=int, default=16_700_000)
    variants = cpu_adam.supported_variants()
    parser.add_argument(
        "--variant", choices=variants, default=next(v for v in ("avx512", "avx2", "scalar") if v in variants)
    )
