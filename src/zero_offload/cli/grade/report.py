"""What a grading run found, task by task, and the table `zo grade N` prints from it.

run.py runs the tests; the pytest plugin inside the run (plugin.py) records each one's outcome;
`summarize` turns those records into one result per task.
"""

from __future__ import annotations

import textwrap
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from .labs import Lab, Task

WIDTH = 100  # the table fits a 100-column terminal


@dataclass(frozen=True)
class TaskResult:
    task: Task
    passed: bool
    n_tests: int
    first_failure: str  # "Type: first line of the message [test name]", why nothing ran, or why it skipped
    status: str  # PASS, FAIL, SKIPPED (this machine cannot run any of its tests), or NO TESTS
    details: tuple[str, ...] = ()  # printed under the table: the lines after the first, e.g. a compiler's

    @property
    def skipped(self) -> bool:
        return self.status == "SKIPPED"


@dataclass(frozen=True)
class GradeResult:
    lab: Lab
    source: Path  # the directory the lab's files came from
    tasks: tuple[TaskResult, ...]
    errors: tuple[str, ...]  # what stopped tests from being collected or run at all
    output: str  # pytest's own output, shown by `zo grade N -v`

    @property
    def passed(self) -> bool:
        """Every task passed, or was skipped because this machine cannot run it (and at least one passed)."""
        return all(t.passed or t.skipped for t in self.tasks) and any(t.passed for t in self.tasks)

    @property
    def points(self) -> int:
        return sum(t.task.points for t in self.tasks if t.passed)

    def table(self) -> str:
        widths = (4, 34, 6, 8, WIDTH - 52 - 4 * 3)  # the last column, the failure, takes what is left

        def row(*cells: str) -> str:
            return " | ".join(_fit(c, w) for c, w in zip(cells, widths, strict=True)).rstrip()

        lab, total = self.lab, sum(t.points for t in self.lab.tasks)
        head = [f"Lab {lab.number}: {lab.title}", f"files from {self.source}", ""]
        head += [f"error: {e}" for e in self.errors] + [""] * bool(self.errors)
        rule = "-+-".join("-" * w for w in widths)
        rows = [
            row(t.task.id, t.task.title, f"{t.task.points:>6}", t.status, t.first_failure) for t in self.tasks
        ]
        n_passed = sum(t.passed for t in self.tasks)
        tail = (
            f"Lab {lab.number}: {n_passed} of {len(self.tasks)} tasks passed, {self.points} / {total} points"
        )
        skipped = [t.task.id for t in self.tasks if t.skipped]
        if skipped:
            tail += f"; {', '.join(skipped)} skipped: this machine cannot run them"
        notes = [line for t in self.tasks for line in _notes(t)]
        header = row("Task", "Title", "Points", "Result", "First failure")
        lines = [*head, header, rule, *rows, "", *notes, tail]
        return "\n".join(lines)


def _notes(result: TaskResult) -> list[str]:
    """What the table's last column cuts short, in full under it: why a task was skipped, a compiler's errors."""
    if result.skipped:
        return [
            *textwrap.wrap(f"{result.task.id}: {result.first_failure}", WIDTH, subsequent_indent="    "),
            "",
        ]
    if not result.details:
        return []
    indented = [
        line
        for d in result.details
        for line in textwrap.wrap(d, WIDTH, initial_indent="    ", subsequent_indent="    ")
    ]
    return [_fit(f"{result.task.id}: {result.first_failure}", WIDTH).rstrip(), *indented, ""]


def display_width(text: str) -> int:  # Chinese characters take two columns
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _fit(text: str, width: int) -> str:
    text = text.replace("\n", " ")
    if display_width(text) > width:
        while display_width(text) > width - 1:
            text = text[:-1]
        text += "…"
    return text + " " * (width - display_width(text))


def error_line(text: str) -> str:
    """The line of pytest's output that says what went wrong: the last `E ...` or `ERROR: ...` line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for prefix in ("E ", "ERROR: "):
        hits = [line[len(prefix) :].strip() for line in lines if line.startswith(prefix)]
        if hits:
            return hits[-1]
    return lines[-1] if lines else "no output"


def summarize(lab: Lab, data: dict, output: str = "", source: Path = Path(".")) -> GradeResult:
    """Turn the plugin's results ({"tests": [...], "errors": [...]}) into one result per task."""
    errors = tuple(data.get("errors", ()))
    results = []
    for task in lab.tasks:
        tests = [t for t in data.get("tests", ()) if t["task"] == task.id]
        failed = [t for t in tests if not t["passed"] and not t.get("skipped")]
        skipped = [t for t in tests if t.get("skipped")]
        if errors:  # an error means some tests never ran, so no task can count as passed
            results.append(TaskResult(task, False, len(tests), errors[0], "FAIL"))
        elif failed:
            first = failed[0]
            results.append(
                TaskResult(task, False, len(tests), first["message"], "FAIL", tuple(first["details"]))
            )
        elif tests and len(skipped) == len(tests):
            results.append(TaskResult(task, False, len(tests), skipped[0]["message"], "SKIPPED"))
        elif tests:
            results.append(TaskResult(task, True, len(tests), "", "PASS"))
        else:
            results.append(TaskResult(task, False, 0, f"no test is marked task({task.id!r})", "NO TESTS"))
    return GradeResult(lab, source, tuple(results), errors, output)
