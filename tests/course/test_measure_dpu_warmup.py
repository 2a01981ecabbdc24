"""tools/measure_dpu_warmup.py: its --quick mode trains, writes what the course quotes from, and the committed
course/measured/dpu-warmup.* are the summary of its own runs."""

from __future__ import annotations

import json
from pathlib import Path

from tools import measure_dpu_warmup as tool

REPO = Path(__file__).resolve().parents[2]
MEASURED = REPO / "course" / "measured" / "dpu-warmup.json"


def test_quick_mode_writes_a_summary(tmp_path, capsys):
    out = tmp_path / "dpu.json"
    assert tool.main(["--quick", "--workers", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["start_step"] for r in result["runs"]] == [None, 10]
    summary = result["summary"]
    assert set(summary) == {"no DPU", "start_step 10"}
    runs = {r["start_step"]: r for r in result["runs"]}
    # Before start_step the delayed run is the synchronous one, step for step.
    assert runs[10]["losses"][:11] == runs[None]["losses"][:11]
    assert runs[10]["losses"] != runs[None]["losses"]
    assert out.with_suffix(".txt").read_text() == tool.printed(result)
    assert "start_step 10" in capsys.readouterr().out


def test_committed_results_are_their_own_summary():
    result = json.loads(MEASURED.read_text())
    assert result["summary"] == json.loads(json.dumps(tool.summarize(result["runs"])))
    assert MEASURED.with_suffix(".txt").read_text() == tool.printed(result)
    assert {r["start_step"] for r in result["runs"]} == set(tool.START_STEPS)
    assert {r["seed"] for r in result["runs"]} == set(tool.SEEDS)
