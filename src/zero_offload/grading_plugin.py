"""The pytest plugin inside a grading run (`zo grade N` loads it with `-p zero_offload.grading_plugin`).

It checks that the tests import the overlay built by grading.py (the learner's files), not an installed
copy of the engine; requires every graded test to name its task with `@pytest.mark.task("1.2")`; and
writes each test's outcome to $ZO_GRADING_RESULTS for grading.py to turn into a table.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from zero_offload.grading import LABS, error_line


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
            }

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        test = self.tests.get(report.nodeid)
        if test is None:
            return
        if report.failed or report.skipped:  # a skipped test has not shown that the task works
            if test["passed"] is not False:  # keep the first failure: later ones often follow from it
                test["message"] = f"{_message(report)} [{test['name']}]"
            test["passed"] = False
        elif report.when == "call" and test["passed"] is None:
            test["passed"] = True

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        tests = [{"nodeid": nodeid, **t, "passed": bool(t["passed"])} for nodeid, t in self.tests.items()]
        data = {"tests": tests, "errors": self.errors}
        self.results.write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")


def _message(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):  # (file, line, "Skipped: why")
        return f"skipped: {report.longrepr[2].removeprefix('Skipped: ')}"
    crash = getattr(report.longrepr, "reprcrash", None)
    text = (crash.message if crash else error_line(str(report.longrepr))).strip() or report.outcome
    first = text.splitlines()[0]
    return first if report.when == "call" else f"in {report.when}: {first}"


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
