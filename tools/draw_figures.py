"""Draw the course's figures as PNG files (course/figures/ by default).

    python -m tools.draw_figures [--out DIR] [--only NAME ...]

The figures live in tools/figures/, one module per subject; each is drawn from committed outputs or stated
arithmetic, with no randomness and no network, so a re-run writes the same files.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import matplotlib

from tools.figures import collect

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "course" / "figures"


def main(argv: Sequence[str] | None = None) -> int:
    figures = collect()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"folder for the PNGs (default {DEFAULT_OUT})"
    )
    parser.add_argument("--only", nargs="+", choices=sorted(figures), help="draw only these figures")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with matplotlib.rc_context(matplotlib.rcParamsDefault):  # a user's matplotlibrc changes nothing
        matplotlib.use("Agg")
        for name, draw in figures.items():
            if args.only is None or name in args.only:
                print(draw(args.out / name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
