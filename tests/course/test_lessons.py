"""The lesson notebooks: each .ipynb is built from its jupytext .py, and each runs in smoke mode (ZO_SMOKE=1)."""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat
import pytest

# The same runner as `make lessons`: the test and the target share one implementation.
from tools import run_lessons

REPO = Path(__file__).resolve().parents[2]
# A cell that runs longer than this in smoke mode hangs: nbclient stops it with an error that names the cell.
# How long a notebook takes is not asserted (a busy machine is slow, not wrong).
SMOKE_CELL_TIMEOUT_S = 120

SOURCES = run_lessons.lesson_sources()


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_notebook_is_built_from_its_source(source):
    problem = run_lessons.sync_problem(source)
    assert problem is None, f"{problem}; run `python tools/run_lessons.py {source.stem}`"


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_notebook_runs_in_smoke_mode(source, tmp_path):
    notebook = jupytext.read(source)
    try:
        run_lessons.execute(notebook, smoke=True, timeout=SMOKE_CELL_TIMEOUT_S)
    finally:
        # Kept in pytest's own temporary directory, to read the outputs of a failed run.
        nbformat.write(notebook, tmp_path / f"{source.stem}.ipynb")
