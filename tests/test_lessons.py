"""The lesson notebooks: each .ipynb is built from its jupytext .py, and each runs in smoke mode (ZO_SMOKE=1)."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import jupytext
import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
SMOKE_LIMIT_S = 120

# tools/ is not a package: load the runner by its path, so the test and `make lessons` share one implementation.
_spec = importlib.util.spec_from_file_location("zo_run_lessons", REPO / "tools" / "run_lessons.py")
run_lessons = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_lessons)

SOURCES = run_lessons.lesson_sources()


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_notebook_is_built_from_its_source(source):
    problem = run_lessons.sync_problem(source)
    assert problem is None, f"{problem}; run `python tools/run_lessons.py {source.stem}`"


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_notebook_runs_in_smoke_mode(source, tmp_path):
    notebook = jupytext.read(source)
    start = time.monotonic()
    try:
        run_lessons.execute(notebook, smoke=True, timeout=SMOKE_LIMIT_S)
    finally:
        # Kept in pytest's own temporary directory, to read the outputs of a failed run.
        nbformat.write(notebook, tmp_path / f"{source.stem}.ipynb")
    elapsed = time.monotonic() - start
    assert elapsed < SMOKE_LIMIT_S, (
        f"{source.stem} took {elapsed:.0f} s in smoke mode (limit {SMOKE_LIMIT_S} s)"
    )
