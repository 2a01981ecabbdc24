"""Grade a lab: run its tests against your files and print tasks, points and what failed.

`zo grade 1` (or `make lab1`) copies the engine's package to a temporary directory, swaps in only
lab 1's files from labs/lab1/, and runs the tests marked `lab1` there in a fresh Python process. Only
lab N's files are swapped in, so an unfinished lab 2 cannot break lab 3.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from . import labkit
from .labs import LABS
from .report import GradeResult, error_line, summarize

PACKAGE_DIR = Path(__file__).resolve().parents[2]  # the zero_offload package: cli/grade/run.py
LAB_TESTS = Path("tests", "course", "labs")  # the graded tests, in the repository
TIMEOUT_S = float(os.environ.get("ZO_GRADING_TIMEOUT", 900))  # a deadlocked learner's lab must not hang CI


class GradingError(Exception):
    """The grading run could not start; the message says what to do."""


def _repo_root(repo_root: str | Path | None) -> Path:
    root = Path(repo_root) if repo_root else PACKAGE_DIR.parents[1]
    if not (root / LAB_TESTS).is_dir():
        raise GradingError(
            f"grading needs a clone of the repository ({LAB_TESTS.as_posix()} not found in {root})"
        )
    return root


def _source(lab_dir: Path, lab: int, files: list[str], repo: Path) -> Path:
    base = lab_dir if lab_dir.is_absolute() or lab_dir.exists() else repo / lab_dir
    source = base / f"lab{lab}" if (base / f"lab{lab}").is_dir() else base
    missing = [rel for rel in files if not (source / rel).is_file()]
    if missing:
        raise GradingError(
            f"{source} lacks lab {lab}'s files: {', '.join(missing)} "
            "(`python tools/make_labs.py` writes missing stubs again)"
        )
    return source


def _syntax_errors(package: Path, files: list[str]) -> list[str]:
    errors = []
    for rel in (f for f in files if f.endswith(".py")):
        try:
            compile((package / rel).read_text(encoding="utf-8"), rel, "exec")
        except SyntaxError as err:
            errors.append(f"{rel}, line {err.lineno}: SyntaxError: {err.msg}")
    return errors


def _run_tests(
    lab: int, overlay: Path, repo: Path, tasks: tuple[str, ...] = (), *, first_failure: bool = False
) -> tuple[dict, str]:
    results = overlay / "results.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # e.g. no `-n 2` from a caller
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(overlay), os.environ.get("PYTHONPATH")]))
    env.update(
        ZO_GRADING_RESULTS=str(results),
        ZO_GRADING_OVERLAY=str(overlay),
        ZO_GRADING_LAB=str(lab),
        ZO_GRADING_TASKS=",".join(tasks),
    )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "zero_offload.cli.grade.plugin",
               "-p", "no:cacheprovider", "-p", "no:xdist", "-m", f"lab{lab}", str(repo / LAB_TESTS)]  # fmt: skip
    if first_failure:  # the tests after it show as "did not run", so their tasks cannot pass either
        command.append("-x")
    try:
        run = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        output = (err.stdout or b"").decode(errors="replace")  # bytes, whatever `text` says
        return {"errors": [f"the tests ran longer than {TIMEOUT_S:.0f} s"]}, output
    output = run.stdout + run.stderr
    if not results.is_file():  # pytest stopped before its session began
        return {"errors": [f"pytest could not start: {error_line(output)}"]}, output
    data = json.loads(results.read_text(encoding="utf-8"))
    if not data.get("finished", True):
        _blame_the_crash(data, run.returncode)
    return data, output


def _blame_the_crash(data: dict, returncode: int) -> None:
    """The test process died (a learner's C code writing outside its arrays, say): fail the test that was
    running with the signal's name, and say why the tests after it did not run."""
    how = f"exit status {returncode}"
    if returncode < 0:
        try:
            how = signal.Signals(-returncode).name
        except ValueError:
            how = f"signal {-returncode}"
    crashed = next((t for t in data["tests"] if t["nodeid"] == data.get("running")), None)
    if crashed is None:
        data["errors"].append(f"the test process died ({how}) between tests")
        return
    crashed.update(passed=False, message=f"the test process died ({how}) in this test [{crashed['name']}]")
    crashed["details"] = ["C code that reads or writes past the end of an array can do this"]
    for test in data["tests"]:
        if test["message"] == "did not run":
            test["message"] = f"did not run: the tests stopped at {crashed['name']} ({how})"


def grade(
    lab: int,
    lab_dir: str | Path = "labs",
    *,
    repo_root: str | Path | None = None,
    tasks: tuple[str, ...] = (),
    first_failure: bool = False,
) -> GradeResult:
    """Run lab's graded tests against the files in `lab_dir`/labN, or in `lab_dir` itself (only `tasks`' tests
    if given: the other tasks then show as having no tests). `first_failure`: stop at the first failing test,
    when all one needs to know is whether the task fails (the course's own check that a mistake is caught)."""
    if lab not in LABS:
        raise GradingError(f"there is no lab {lab}; the course has labs {', '.join(map(str, LABS))}")
    spec = LABS[lab]
    if not spec.available:
        name = f"{spec.module} {spec.title.split()[0]}"
        raise GradingError(
            f"Lab {lab} ({name}) is not available yet: module {lab} is not built in this version of the course."
        )
    repo = _repo_root(repo_root)
    files = labkit.lab_files(PACKAGE_DIR, lab)
    if not files:
        raise GradingError(f"lab {lab} has no marked regions in {PACKAGE_DIR}")
    source = _source(Path(lab_dir), lab, files, repo)
    with tempfile.TemporaryDirectory(prefix=f"zo-grade-lab{lab}-") as tmp:
        package = Path(tmp) / "zero_offload"
        shutil.copytree(PACKAGE_DIR, package, ignore=shutil.ignore_patterns("__pycache__"))
        for rel in files:
            shutil.copyfile(source / rel, package / rel)
        broken = _syntax_errors(package, files)  # say where: pytest would only fail to import the package
        if broken:
            data, output = {"errors": broken}, ""
        else:
            data, output = _run_tests(lab, Path(tmp), repo, tasks, first_failure=first_failure)
    return summarize(spec, data, output, source)


HELP = "grade a lab: zo grade 1 [--lab-dir solutions]"


def add_arguments(parser) -> None:
    parser.add_argument("lab", type=int, help="the lab number, 1-5")
    parser.add_argument(
        "--lab-dir", default="labs", help="labs (default), solutions, or a directory of lab files"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show the output of the tests")


def run(args) -> int:
    try:
        result = grade(args.lab, args.lab_dir)
    except (GradingError, labkit.LabMarkerError) as err:
        print(err, file=sys.stderr)
        return 2
    if args.verbose:
        print(result.output)
    print(result.table())
    if not result.passed and not args.verbose:
        print(f"Run `zo grade {args.lab} -v` to see the test output.")
    return 0 if result.passed else 1
