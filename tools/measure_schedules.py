"""Measure module 5's three schedules as `make bench` does, and keep the result for the course to quote.

    python tools/measure_schedules.py                   # measure; write course/measured/bench-schedules-<cpu>.json/.txt
    python tools/measure_schedules.py --out X.json      # measure into X.json and X.txt
    python tools/measure_schedules.py --print X.json    # measure nothing: print X.json as make bench prints it

The .json holds every number compare_schedules returns; the .txt is what `make bench` prints from it, so that a
figure the course quotes (a ratio, a wall time over its bound) can be found in a committed file as printed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
from pathlib import Path

from zero_offload.cli.bench.cpu import machine
from zero_offload.cli.bench.run import write_measured
from zero_offload.cli.bench.schedules import compare_schedules
from zero_offload.cli.bench.training import print_schedules

REPO = Path(__file__).resolve().parents[1]
# (cores, staging slots, C Adam variant): the rows of make bench's module 5 section.
RUNS = [("split", 4, "widest"), ("shared", 4, "widest"), ("split", 2, "widest"), ("split", 16, "widest")]
RUNS.append(("split", 4, "scalar"))
COMMAND = (
    'compare_schedules("10m", seq_len=8, steps=8, rounds=8, cores=C, slots=S, variant=V) for each row of '
    "tools/measure_schedules.py: the schedules part of make bench's module 5 section"
)


def measure(plots: Path | None = None) -> dict:
    result = {"command": COMMAND, "machine": machine(), "schedules": {}}
    for cores, slots, variant in RUNS:
        out_dir = plots if plots is not None and (slots, variant) == (4, "widest") else None
        r = compare_schedules(
            "10m", seq_len=8, steps=8, rounds=8, cores=cores, slots=slots, variant=variant, out_dir=out_dir
        )
        key = f"{cores}, {slots} slots, batch 1 x 8, {variant} C Adam"
        result["schedules"][key] = {k: v for k, v in r.items() if k not in ("losses", "plots")}
    return result


def printed(result: dict) -> str:
    """What make bench prints for these results."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        about = result["machine"]
        print(
            f"CPU: {about['cpu']}; C Adam variant: {about['kernel_variant']}; caches: {about['caches_text']}"
        )
        print(result["command"])
        for key, r in result["schedules"].items():
            print_schedules(key, r)
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="where to write the .json (the .txt goes beside it)")
    parser.add_argument("--print", dest="source", type=Path, help="print a results file; measure nothing")
    args = parser.parse_args(argv)
    if args.source is not None:
        print(printed(json.loads(args.source.read_text())), end="")
        return 0
    result = measure()
    slug = re.sub(r"[^a-z0-9]+", "-", result["machine"]["cpu"].lower()).strip("-")
    out = args.out or REPO / "course" / "measured" / f"bench-schedules-{slug}.json"
    json_file, text_file = write_measured(out, result, printed(result))
    print(f"wrote {json_file} and {text_file}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
