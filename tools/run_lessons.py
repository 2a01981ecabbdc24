"""Execute the lesson notebooks in lessons/: the jupytext `.py` files are the source, the `.ipynb` files are built.

    python tools/run_lessons.py                  # every lessons/0*_*.py: regenerate its .ipynb, execute it in place
    python tools/run_lessons.py 01_basics        # only these lessons (a name, a prefix such as 01, or a path)
    python tools/run_lessons.py --smoke          # ZO_SMOKE=1, executed into a temporary copy; notebooks untouched
    python tools/run_lessons.py --check-sync     # execute nothing; exit 1 if an .ipynb's cells differ from its .py

Notebooks run in the `python3` kernel with lessons/ as the working directory, as they do under `make jupyter`.
`make lessons` runs this script without flags.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

REPO = Path(__file__).resolve().parents[1]
LESSONS = REPO / "lessons"
CELL_TIMEOUT_S = 600
KERNEL = "python3"


def lesson_sources(names: list[str] | None = None, lessons_dir: Path = LESSONS) -> list[Path]:
    """The jupytext sources to run: all lessons/0*_*.py, or those the names select."""
    every = sorted(lessons_dir.glob("0*_*.py"))
    if not names:
        return every
    chosen = []
    for name in names:
        stem = Path(name).name.removesuffix(".py").removesuffix(".ipynb")
        matches = [p for p in every if p.stem == stem] or [p for p in every if p.stem.startswith(stem)]
        if not matches:
            known = ", ".join(p.stem for p in every) or "none"
            raise SystemExit(f"error: no lesson matches {name!r} (lessons: {known})")
        chosen.extend(m for m in matches if m not in chosen)
    return chosen


def notebook_path(source: Path) -> Path:
    return source.with_suffix(".ipynb")


def cell_sources(notebook) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in notebook.cells]


def sync_problem(source: Path) -> str | None:
    """Why the .ipynb beside `source` is not what jupytext makes of it (cell sources only), or None."""
    target = notebook_path(source)
    if not target.exists():
        return f"{target.relative_to(REPO)} does not exist"
    want = cell_sources(jupytext.read(source))
    have = cell_sources(nbformat.read(target, as_version=4))
    if want == have:
        return None
    if len(want) != len(have):
        return f"{target.name} has {len(have)} cells, {source.name} makes {len(want)}"
    first = next(i for i, (w, h) in enumerate(zip(want, have, strict=True)) if w != h)
    return f"{target.name} differs from {source.name} at cell {first}"


def execute(notebook, *, smoke: bool, timeout: int = CELL_TIMEOUT_S, progress: bool = False):
    """Run every cell of `notebook` (in place) with lessons/ as the working directory; return it."""
    env = dict(os.environ)
    if smoke:
        env["ZO_SMOKE"] = "1"
    else:
        env.pop("ZO_SMOKE", None)
    client = NotebookClient(
        notebook, timeout=timeout, kernel_name=KERNEL, resources={"metadata": {"path": str(LESSONS)}}
    )
    if progress and sys.stdout.isatty():  # a live counter on a terminal; logs get the per-notebook lines only
        start, total = time.monotonic(), sum(cell.cell_type == "code" for cell in notebook.cells)
        done = 0

        def on_cell_executed(cell, cell_index, execute_reply):
            nonlocal done
            done += 1
            print(f"\r  cell {done}/{total}  {time.monotonic() - start:6.1f} s", end="", flush=True)

        client.on_cell_executed = on_cell_executed
    try:
        client.execute(env=env)
    finally:
        if progress and sys.stdout.isatty():
            print()
    return notebook


def run(source: Path, *, smoke: bool, progress: bool = True) -> tuple[float, Path]:
    """Regenerate and execute one lesson; return the seconds it took and where the executed notebook is.

    In place the executed notebook replaces lessons/NAME.ipynb (also when a cell fails, so the error shows where
    it happened); in smoke mode it goes to a new temporary directory. Raises nbclient's errors on failure.
    """
    notebook = jupytext.read(source)
    target = notebook_path(source)
    if smoke:
        target = Path(tempfile.mkdtemp(prefix=f"zo-{source.stem}-")) / target.name
    start = time.monotonic()
    try:
        execute(notebook, smoke=smoke, progress=progress)
    finally:
        nbformat.write(notebook, target)
    return time.monotonic() - start, target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="lessons to run, e.g. 01_basics or 01 (default: all)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="set ZO_SMOKE=1 and execute into a temporary copy (committed notebooks untouched)",
    )
    parser.add_argument(
        "--check-sync",
        action="store_true",
        help="execute nothing; exit 1 if any .ipynb's cell sources differ from its .py",
    )
    args = parser.parse_args(argv)
    sources = lesson_sources(args.names)
    if not sources:
        print("no lessons found (lessons/0*_*.py)")
        return 0

    if args.check_sync:
        problems = [p for p in map(sync_problem, sources) if p]
        for problem in problems:
            print(f"out of sync: {problem}")
        if problems:
            print("regenerate with `python tools/run_lessons.py` (or `jupytext --to ipynb lessons/NAME.py`)")
            return 1
        print(f"{len(sources)} notebook(s) in sync with their .py sources")
        return 0

    failed = []
    mode = "smoke mode (ZO_SMOKE=1), temporary copy" if args.smoke else "in place"
    for i, source in enumerate(sources, 1):
        print(f"[{i}/{len(sources)}] {source.stem}: executing {mode}", flush=True)
        start = time.monotonic()
        try:
            seconds, written = run(source, smoke=args.smoke)
        except (CellExecutionError, CellTimeoutError, DeadKernelError) as err:
            failed.append(source.stem)
            print(f"[{i}/{len(sources)}] {source.stem}: FAILED after {time.monotonic() - start:.1f} s\n{err}")
            continue
        where = written.relative_to(REPO) if written.is_relative_to(REPO) else written
        print(f"[{i}/{len(sources)}] {source.stem}: done in {seconds:.1f} s -> {where}", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
