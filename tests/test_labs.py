"""The graders are honest: for every available lab, the solutions pass, the untouched stubs fail every task,
each plausible wrong solution in tests/labs/mutants.py fails its task, and labs/ and solutions/ match src/.

Each grading run is a fresh pytest process (as `zo grade` runs it), so these tests are slow-ish.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from zero_offload import grading, labkit

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "zero_offload"
AVAILABLE = [n for n, lab in grading.LABS.items() if lab.available]
MUTANTS = runpy.run_path(str(REPO / "tests" / "labs" / "mutants.py"))["MUTANTS"]
CASES = [
    pytest.param(task, code, id=f"{task}-{name}") for task, cases in MUTANTS.items() for name, code in cases
]


def _require_lab(lab: int) -> None:
    regions = labkit.scan(SRC)
    # While the course is first being written there is nothing to check yet; after that, silence is a bug.
    if not regions or not any((REPO / "tests" / "labs").glob("test_*.py")):
        pytest.skip("no lab markers in src/ or no graded tests in tests/labs/ yet")
    if not any(r.lab == lab for rs in regions.values() for r in rs):
        pytest.fail(f"lab {lab} is marked available but src has no regions")


def _failure_report(result: grading.GradeResult) -> str:
    return f"{result.table()}\n--- pytest output (tail) ---\n{result.output[-4000:]}"


def test_generated_labs_and_solutions_match_src():
    report = labkit.generate(REPO, check=True)
    assert report.ok, "run `python tools/make_labs.py`; these differ from src/:\n" + "\n".join(report.changes)


@pytest.mark.parametrize("lab", AVAILABLE)
def test_solutions_pass_every_task(lab):
    _require_lab(lab)
    result = grading.grade(lab, REPO / "solutions", repo_root=REPO)
    assert result.passed, _failure_report(result)


@pytest.mark.parametrize("lab", AVAILABLE)
def test_untouched_stubs_fail_every_task(lab, tmp_path):
    _require_lab(lab)
    # A fresh render, not the working copy of labs/: a learner's own progress must not fail this test.
    labkit.write_lab(SRC, lab, tmp_path, solution=False)
    result = grading.grade(lab, tmp_path, repo_root=REPO)
    assert not result.errors, _failure_report(result)  # they must fail in their tests, not before them
    passing = [t.task.id for t in result.tasks if t.passed]
    assert not passing, f"tasks {passing} pass with the stub in place\n" + _failure_report(result)


@pytest.mark.parametrize(("task_id", "code"), CASES)
def test_mutant_fails_its_task(task_id, code, tmp_path):
    lab = grading.LABS.get(int(task_id.split(".")[0]))
    if lab is None or task_id not in [t.id for t in lab.tasks]:
        pytest.fail(f"tests/labs/mutants.py names task {task_id}, which no lab has")
    if not lab.available:
        pytest.skip(f"lab {lab.number} is not available yet")
    _require_lab(lab.number)
    labkit.write_lab(SRC, lab.number, tmp_path, solution=True)
    rel = next(rel for rel, regions in labkit.scan(SRC).items() if any(r.task_id == task_id for r in regions))
    mutated = labkit.replace_region((tmp_path / rel).read_text(encoding="utf-8"), task_id, code, rel)
    if rel.endswith(".py"):  # a typo would get the mutant "caught" for the wrong reason
        compile(mutated, rel, "exec")
    (tmp_path / rel).write_text(mutated, encoding="utf-8")
    result = grading.grade(lab.number, tmp_path, repo_root=REPO, tasks=(task_id,))
    assert not result.errors, _failure_report(result)
    task = next(t for t in result.tasks if t.task.id == task_id)
    assert task.n_tests and not task.passed, (
        f"Lab {task_id}'s tests miss this mistake\n{_failure_report(result)}"
    )
