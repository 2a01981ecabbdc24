"""The pytest plugin inside a grading run (`zo grade N` loads it with `-p zero_offload.cli.grade.plugin`).

It checks that the tests import the overlay built by run.py (the learner's files), not an installed
copy of the engine; requires every graded test to name its task with `@pytest.mark.task("1.2")`; and
writes each test's outcome to $ZO_GRADING_RESULTS for run.py to turn into a table. The file is
rewritten as each test starts, so that if a learner's C code kills the process, run.py still knows
which test was running.

A test skipped by a `skipif` mark whose condition holds (a machine that cannot run it, e.g. an AVX task on
ARM) is recorded as skipped, not failed; any other skip counts as a failure.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from .labs import LABS
from .report import error_line


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise pytest.UsageError(f"{name} is not set: this plugin only runs inside `zo grade`")
    return value


def _outside(overlay: Path) -> list[str]:
    """Where zero_offload, or any of its modules, came from if not from the overlay."""
    modules = [module for name, module in list(sys.modules.items()) if name.startswith("zero_offload.")]
    places = [*sys.modules["zero_offload"].__path__, *(getattr(m, "__file__", None) for m in modules)]
    return sorted({p for p in places if p and not Path(p).resolve().is_relative_to(overlay)})


class _Recorder:
    def __init__(self, lab: int, overlay: Path, results: Path):
        self.lab, self.overlay, self.results = lab, overlay, results
        self.tests: dict[str, dict] = {}  # nodeid -> outcome, in the order the tests were collected
        self.errors: list[str] = []
        self.running: str | None = None

    def _fail(self, message: str) -> None:
        self.errors.append(message)
        raise pytest.UsageError(message)

    def check_overlay(self) -> None:
        # An editable install, or a copy in site-packages, found first would grade the engine's own solution.
        outside = _outside(self.overlay)
        if outside:
            more = f" and {len(outside) - 1} more" if len(outside) > 1 else ""
            where = f"{outside[0]}{more}, not from the grading copy in {self.overlay}"
            self._fail(
                f"zero_offload was imported from {where}; remove PYTHONPATH entries or installs that shadow it"
            )

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.errors.append(f"{report.nodeid or 'collection'}: {error_line(str(report.longrepr))}")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.check_overlay()  # again, now that the test modules have imported what they use
        ids = [t.id for t in LABS[self.lab].tasks]
        for item in session.items:
            marker = item.get_closest_marker("task")
            task = marker.args[0] if marker and marker.args else None
            if task not in ids:
                fix = f"mark it @pytest.mark.task(...) with one of {', '.join(ids)}"
                self._fail(f"{item.nodeid} is marked lab{self.lab} but its task is {task!r}; {fix}")
            self.tests[item.nodeid] = {
                "task": task,
                "name": item.name,
                "passed": None,
                "message": "did not run",
                "details": [],
                "skipped": False,
                # skipif(True, ...): this machine cannot run the test, which the learner's code cannot change
                "skippable": any(m.args and m.args[0] is True for m in item.iter_markers("skipif")),
            }

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.running = nodeid
        self._write(finished=False)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        test = self.tests.get(report.nodeid)
        if test is None:
            return
        if report.skipped and report.when == "setup" and test["skippable"]:
            test.update(skipped=True, message=_message(report)[0].removeprefix("skipped: "))
        elif report.failed or report.skipped:  # any other skip has not shown that the task works
            if test["passed"] is not False:  # keep the first failure: later ones often follow from it
                first, details = _message(report)
                test.update(message=f"{first} [{test['name']}]", details=details)
            test["passed"] = False
        elif report.when == "call" and test["passed"] is None:
            test["passed"] = True

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.running = None
        self._write(finished=True)

    def _write(self, *, finished: bool) -> None:
        tests = [{"nodeid": nodeid, **t, "passed": bool(t["passed"])} for nodeid, t in self.tests.items()]
        data = {"tests": tests, "errors": self.errors, "running": self.running, "finished": finished}
        self.results.write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")


DETAIL_LINES = 8  # of a message written for the learner, e.g. a compiler's errors


def _message(report: pytest.TestReport) -> tuple[str, list[str]]:
    """The first line of what went wrong, and, for a message a test wrote itself, the lines after it."""
    if report.skipped and isinstance(report.longrepr, tuple):  # (file, line, "Skipped: why")
        return f"skipped: {report.longrepr[2].removeprefix('Skipped: ')}", []
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash and crash.message.startswith(
        "Failed: "
    ):  # pytest.fail(message): all of it written for the learner
        lines = crash.message.removeprefix("Failed: ").strip().splitlines() or [report.outcome]
        return lines[0], lines[1 : 1 + DETAIL_LINES]
    text = (crash.message if crash else error_line(str(report.longrepr))).strip() or report.outcome
    first = text.splitlines()[0]
    return (first if report.when == "call" else f"in {report.when}: {first}"), []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ZO_GRADING_TASKS=2.2,2.3 only those tasks' tests run (the mutant checks grade one task each)."""
    wanted = set(filter(None, os.environ.get("ZO_GRADING_TASKS", "").split(",")))
    if not wanted:
        return
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("task")
        (keep if marker and marker.args and marker.args[0] in wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_configure(config: pytest.Config) -> None:
    overlay = Path(_env("ZO_GRADING_OVERLAY")).resolve()
    recorder = _Recorder(int(_env("ZO_GRADING_LAB")), overlay, Path(_env("ZO_GRADING_RESULTS")))
    recorder.check_overlay()
    config.pluginmanager.register(recorder, "zo-grading-recorder")
