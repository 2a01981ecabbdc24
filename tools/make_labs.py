"""Regenerate labs/labN (learner stubs) and solutions/labN from the marked regions in src/zero_offload.

    python tools/make_labs.py            # write what changed; files you edited in labs/ are left alone
    python tools/make_labs.py --force    # overwrite your edits in labs/ too
    python tools/make_labs.py --check    # change nothing; exit 1 if labs/ or solutions/ lag behind src/

The work is done by zero_offload.cli.grade.labkit; this is only its command line.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# This clone's labkit, loaded by its path rather than through the package: regenerating the labs must work
# without torch and while the engine half-written in src/ does not import.
_spec = importlib.util.spec_from_file_location(
    "zero_offload_labkit", REPO / "src" / "zero_offload" / "cli" / "grade" / "labkit.py"
)
labkit = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(labkit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report differences (exit 1 if any)")
    parser.add_argument("--force", action="store_true", help="overwrite lab files you edited")
    parser.add_argument("--repo", type=Path, default=REPO, help="repository root (default: this clone)")
    args = parser.parse_args(argv)
    try:
        report = labkit.generate(args.repo, check=args.check, force=args.force)
    except labkit.LabMarkerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for notice in report.kept:
        print(f"note: {notice}")
    if args.check:
        if report.ok:
            print("labs/ and solutions/ match src/.")
            return 0
        print("labs/ and solutions/ differ from what src/ generates:")
        print("\n".join(f"  {change}" for change in report.changes))
        print("run `python tools/make_labs.py` (or `make labs`) to regenerate them")
        return 1
    print(
        "\n".join(f"updated {change}" for change in report.changes) or "labs/ and solutions/ are up to date."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
