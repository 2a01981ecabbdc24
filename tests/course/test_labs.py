"""The graders are honest: for every available lab, the solutions pass, the untouched stubs fail every task,
each plausible wrong solution in tests/course/labs/mutants.py fails its task, and labs/ and solutions/ match src/.

Each grading run is a fresh pytest process (as `zo grade` runs it), so these tests are slow-ish. A C mutant
(lab 4) is checked in this process instead: its kernel is compiled, and the task's graded tests are called
on it directly, which takes a second or two rather than a grading run.
"""

from __future__ import annotations

import functools
import inspect
import runpy
from pathlib import Path

import pytest

from zero_offload.cli.grade import labkit
from zero_offload.cli.grade import run as grading

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "zero_offload"
AVAILABLE = [n for n, lab in grading.LABS.items() if lab.available]
MUTANTS = runpy.run_path(str(REPO / "tests" / "course" / "labs" / "mutants.py"))["MUTANTS"]
CASES = [
    pytest.param(task, code, id=f"{task}-{name}") for task, cases in MUTANTS.items() for name, code in cases
]


def _require_lab(lab: int) -> None:
    regions = labkit.scan(SRC)
    # While the course is first being written there is nothing to check yet; after that, silence is a bug.
    if not regions or not any((REPO / "tests" / "course" / "labs").glob("test_*.py")):
        pytest.skip("no lab markers in src/ or no graded tests in tests/course/labs/ yet")
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


def _mutate(text: str, task_id: str, code: str | tuple[str, str], rel: str) -> str:
    if isinstance(code, str):
        return labkit.replace_region(text, task_id, code, rel)
    old, new = code
    region = next(r for r in labkit.find_regions(text, rel) if r.task_id == task_id)
    lines = text.splitlines(keepends=True)
    body = "".join(lines[region.start - 1 : region.end])
    # Exactly once: a mutant whose text the solution no longer has would pass for the wrong reason.
    assert body.count(old) == 1, f"{old!r} occurs {body.count(old)} times in Lab {task_id}'s region of {rel}"
    lines[region.start - 1 : region.end] = [body.replace(old, new)]
    return "".join(lines)


@functools.cache
def _graded_c_tests() -> dict:
    return runpy.run_path(str(REPO / "tests" / "course" / "labs" / "test_lab4.py"))


def _c_failures(task_id: str, text: str) -> dict[str, list[str]]:
    """Call every graded test of `task_id` here, on the C file `text`: the failures by the kernel the tests
    take ("kernel": yours in the engine; "portable_kernel": Lab 4.3's harness, which runs on any machine).
    A kernel whose tests this machine cannot run (skipif) is left out."""
    tests = _graded_c_tests()
    kernels = {
        "kernel": lambda: tests["kernel_for"](task_id, text),
        "portable_kernel": lambda: tests["kernel_for"](task_id, text, portable=True),
    }
    failures: dict[str, list[str]] = {}
    for name, function in tests.items():
        marks = getattr(function, "pytestmark", [])
        if not name.startswith("test_") or not any(m.name == "task" and m.args == (task_id,) for m in marks):
            continue
        (kind,) = inspect.signature(function).parameters  # each graded C test takes one kernel
        if kind == "kernel" and any(m.name == "skipif" and m.args[0] is True for m in marks):
            continue
        try:
            kernel = kernels[kind]()
        except pytest.fail.Exception as err:  # a typo would get the mutant "caught" for the wrong reason
            pytest.fail(f"the C file does not compile for Lab {task_id}: {err}")
        failures.setdefault(kind, [])
        try:
            function(kernel)
        except (Exception, pytest.fail.Exception) as err:
            failures[kind].append(f"{name}: {type(err).__name__}: {str(err).splitlines()[0]}")
    if not failures:
        pytest.skip(f"this machine cannot run Lab {task_id}'s tests")
    return failures


@pytest.mark.parametrize(("task_id", "code"), CASES)
def test_mutant_fails_its_task(task_id, code, tmp_path):
    lab = grading.LABS.get(int(task_id.split(".")[0]))
    if lab is None or task_id not in [t.id for t in lab.tasks]:
        pytest.fail(f"tests/course/labs/mutants.py names task {task_id}, which no lab has")
    if not lab.available:
        pytest.skip(f"lab {lab.number} is not available yet")
    _require_lab(lab.number)
    labkit.write_lab(SRC, lab.number, tmp_path, solution=True)
    rel = next(rel for rel, regions in labkit.scan(SRC).items() if any(r.task_id == task_id for r in regions))
    mutated = _mutate((tmp_path / rel).read_text(encoding="utf-8"), task_id, code, rel)
    if rel.endswith(".c"):
        missed = [kind for kind, failures in _c_failures(task_id, mutated).items() if not failures]
        assert not missed, f"Lab {task_id}'s tests that take {' and '.join(missed)} miss this mistake"
        return
    compile(mutated, rel, "exec")  # a typo would get the mutant "caught" for the wrong reason
    (tmp_path / rel).write_text(mutated, encoding="utf-8")
    # Stop at the first failing test: whether the task fails is all this asks.
    result = grading.grade(lab.number, tmp_path, repo_root=REPO, tasks=(task_id,), first_failure=True)
    assert not result.errors, _failure_report(result)
    task = next(t for t in result.tasks if t.task.id == task_id)
    assert task.n_tests and not task.passed, (
        f"Lab {task_id}'s tests miss this mistake\n{_failure_report(result)}"
    )


def test_lab4_portable_tail_test_passes_the_solution_and_fails_the_stub():
    # Where the AVX2 loop cannot run (ARM), Lab 4.3 is graded in a portable harness alone; it must be honest too.
    rel = "tuning/csrc/cpu_adam.c"
    solution = (SRC / rel).read_text(encoding="utf-8")
    assert _c_failures("4.3", solution)["portable_kernel"] == []
    stub = labkit.render_stub(solution, rel, 4)
    assert any("NotImplementedError: Lab 4.3" in f for f in _c_failures("4.3", stub)["portable_kernel"])


def test_lab4_on_arm64_skips_the_avx_tasks_and_grades_the_tail(monkeypatch):
    monkeypatch.setenv("ZO_LAB4_MACHINE", "arm64")
    result = grading.grade(4, REPO / "solutions", repo_root=REPO)
    status = {t.task.id: t for t in result.tasks}
    # 4.3 in its portable harness and 4.4 (Python) run on any machine.
    assert status["4.3"].passed and status["4.4"].passed, _failure_report(result)
    assert result.passed and result.points == 48, _failure_report(result)
    for task in ("4.1", "4.2"):
        assert status[task].skipped, _failure_report(result)
        assert status[task].first_failure.startswith(
            f"Lab {task} needs an x86-64 CPU with AVX2/FMA/F16C; this machine is arm64"
        )
    assert "4.1, 4.2 skipped: this machine cannot run them" in result.table()
