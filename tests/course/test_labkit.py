"""labkit, tools/make_labs.py and the grader, on a tiny synthetic package (not the course's own markers)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zero_offload.cli import main as zo_main
from zero_offload.cli.grade import labkit
from zero_offload.cli.grade import report as grading_report
from zero_offload.cli.grade import run as grading

REPO = Path(__file__).resolve().parents[2]

TOY = '''\
"""A toy module with two lab regions."""


def scale(xs, factor):
    """Multiply every element."""
    # BEGIN LAB 1.1: Scale a list
    # Return a new list with every element times factor.
    # Do not modify xs.
    out = [x * factor for x in xs]
    return out
    # END LAB 1.1


class Counter:
    def bump(self, n):
        if n > 0:
            # BEGIN LAB 1.2: Count "positive" steps
            self.total = getattr(self, "total", 0) + n
            # END LAB 1.2
        return self
'''

DEEP = """\
def shift(xs, k):
    # BEGIN LAB 1.3: Shift a list
    # Rotate left by k.
    return xs[k:] + xs[:k]
    # END LAB 1.3


def later(x):
    # BEGIN LAB 2.1: A task of another lab
    return x
    # END LAB 2.1
"""

KERNEL = """\
#include <stddef.h>

void add(float *x, const float *y, size_t n) {
    /* BEGIN LAB 4.1: Add two arrays */
    // x[i] += y[i] for every i.
    /* Keep it simple:
       one loop is enough. */
    for (size_t i = 0; i < n; ++i) x[i] += y[i];
    /* END LAB 4.1 */
}
"""


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    pkg = tmp_path / "src" / "zero_offload"
    _write(pkg / "__init__.py", "")
    _write(pkg / "toy.py", TOY)
    _write(pkg / "sub" / "deep.py", DEEP)
    _write(pkg / "kern.c", KERNEL)
    _write(pkg / "plain.py", "def f():\n    return 1\n")
    return tmp_path


# --- markers and rendering --------------------------------------------------------------------------


def test_find_regions_reads_ids_titles_lines_and_instructions():
    first, second = labkit.find_regions(TOY, "toy.py")
    assert (first.task_id, first.lab, first.title, first.start, first.end) == (
        "1.1",
        1,
        "Scale a list",
        6,
        11,
    )
    assert first.indent == "    "
    assert first.instructions == (
        "    # Return a new list with every element times factor.",
        "    # Do not modify xs.",
    )
    assert (second.task_id, second.title, second.indent, second.instructions) == (
        "1.2",
        'Count "positive" steps',
        "            ",
        (),
    )


def test_stub_keeps_instructions_and_raises_at_the_region_indentation():
    stub = labkit.render_stub(TOY, "toy.py")
    assert "# Lab 1.1: Scale a list\n    # Return a new list" in stub
    assert '    raise NotImplementedError("Lab 1.1: Scale a list")\n' in stub
    assert '            raise NotImplementedError("Lab 1.2: Count \\"positive\\" steps")\n' in stub
    assert "BEGIN LAB" not in stub and "END LAB" not in stub and "x * factor" not in stub
    assert stub.startswith('"""A toy module') and "        return self\n" in stub  # the rest is untouched
    namespace: dict = {}
    exec(compile(stub, "toy.py", "exec"), namespace)
    with pytest.raises(NotImplementedError, match=r"^Lab 1\.1: Scale a list$"):
        namespace["scale"]([1], 2)
    with pytest.raises(NotImplementedError, match="Lab 1.2"):
        namespace["Counter"]().bump(1)
    assert isinstance(namespace["Counter"]().bump(-1), namespace["Counter"])


def test_stub_of_one_lab_leaves_the_other_labs_regions_alone():
    stub = labkit.render_stub(DEEP, "deep.py", lab=2)
    assert "return xs[k:] + xs[:k]" in stub and "# BEGIN LAB 1.3" in stub
    assert 'raise NotImplementedError("Lab 2.1: A task of another lab")' in stub


def test_c_stub_keeps_comment_instructions_and_calls_the_macro():
    stub = labkit.render_stub(KERNEL, "kern.c")
    want = textwrap.dedent("""\
        void add(float *x, const float *y, size_t n) {
            /* Lab 4.1: Add two arrays */
            // x[i] += y[i] for every i.
            /* Keep it simple:
               one loop is enough. */
            ZO_LAB_NOT_IMPLEMENTED("Lab 4.1: Add two arrays");
        }
        """)
    assert stub.endswith(want)


def test_replace_region_reindents_and_replaces_the_markers():
    mutant = labkit.replace_region(
        TOY, "1.2", "\n    self.total = n  # forgets the old total\n\n    pass\n", "toy.py"
    )
    assert (
        "            self.total = n  # forgets the old total\n\n            pass\n        return self"
        in mutant
    )
    assert "LAB 1.2" not in mutant and "# BEGIN LAB 1.1" in mutant
    namespace: dict = {}
    exec(compile(mutant, "toy.py", "exec"), namespace)
    assert namespace["Counter"]().bump(2).bump(3).total == 3
    with pytest.raises(labkit.LabMarkerError, match="no region for Lab 1.9"):
        labkit.replace_region(TOY, "1.9", "pass", "toy.py")


BAD = {
    "unmatched BEGIN": ("def f():\n    # BEGIN LAB 1.1: t\n    pass\n", 2, "has no END LAB 1.1"),
    "unmatched END": ("def f():\n    pass\n    # END LAB 1.1\n", 3, "has no BEGIN LAB 1.1"),
    "nested": (
        "def f():\n    # BEGIN LAB 1.1: a\n    # BEGIN LAB 1.2: b\n    # END LAB 1.2\n    # END LAB 1.1\n",
        3,
        "nested region",
    ),
    "mismatched id": ("def f():\n    # BEGIN LAB 1.1: a\n    pass\n    # END LAB 1.2\n", 4, "closes Lab 1.1"),
    "END indented differently": (
        "def f():\n    # BEGIN LAB 1.1: a\n    pass\n        # END LAB 1.1\n",
        4,
        "indented",
    ),
    "duplicate id": (
        "def f():\n    # BEGIN LAB 1.1: a\n    pass\n    # END LAB 1.1\n"
        "def g():\n    # BEGIN LAB 1.1: b\n    pass\n    # END LAB 1.1\n",
        6,
        "marked twice",
    ),
    "malformed": ("def f():\n    # BEGIN LAB 1.1 no colon\n    pass\n", 2, "malformed lab marker"),
    "module level": ("# BEGIN LAB 1.1: a\nx = 1\n# END LAB 1.1\n", 1, "inside a function body"),
}


@pytest.mark.parametrize("case", BAD)
def test_marker_errors_name_the_file_and_line(case):
    text, line, message = BAD[case]
    with pytest.raises(labkit.LabMarkerError, match=f"^bad.py:{line}: .*{message}"):
        labkit.render_stub(text, "bad.py")


def test_duplicate_ids_across_files_are_an_error(repo):
    _write(
        repo / "src" / "zero_offload" / "other.py",
        "def g():\n    # BEGIN LAB 1.3: again\n    pass\n    # END LAB 1.3\n",
    )
    with pytest.raises(labkit.LabMarkerError, match=r"Lab 1\.3 is marked twice") as raised:
        labkit.scan(repo / "src" / "zero_offload")
    assert "other.py:2" in str(raised.value) and "deep.py:2" in str(raised.value)


def test_lab_files_are_the_files_with_a_region_of_that_lab(repo):
    src = repo / "src" / "zero_offload"
    assert labkit.lab_files(src, 1) == ["sub/deep.py", "toy.py"]
    assert labkit.lab_files(src, 2) == ["sub/deep.py"]
    assert labkit.lab_files(src, 4) == ["kern.c"]
    assert labkit.lab_files(src, 3) == []


# --- generating labs/ and solutions/ ----------------------------------------------------------------


def test_generate_writes_stubs_solutions_and_a_record(repo):
    _write(repo / "labs" / "lab1" / "README.md", "by hand\n")
    report = labkit.generate(repo)
    src = repo / "src" / "zero_offload"
    assert (repo / "solutions" / "lab1" / "toy.py").read_text() == TOY
    assert (repo / "labs" / "lab1" / "toy.py").read_text() == labkit.render_stub(TOY, "toy.py")
    assert (repo / "labs" / "lab2" / "sub" / "deep.py").read_text() == labkit.render_stub(
        DEEP, "deep.py", lab=2
    )
    assert "ZO_LAB_NOT_IMPLEMENTED" in (repo / "labs" / "lab4" / "kern.c").read_text()
    assert (repo / "labs" / "lab1" / "README.md").read_text() == "by hand\n"
    assert not (repo / "labs" / "lab1" / "plain.py").exists()
    record = json.loads((repo / "labs" / "lab1" / labkit.RECORD).read_text())
    assert sorted(record) == ["sub/deep.py", "toy.py"]
    assert "labs/lab1/toy.py (missing)" in report.changes
    assert labkit.generate(repo).changes == [] and labkit.generate(repo, check=True).ok
    assert labkit.render_lab(src, 1)["toy.py"][1] == TOY


def test_a_learners_edit_survives_regeneration_until_forced(repo):
    labkit.generate(repo)
    lab_file = repo / "labs" / "lab1" / "toy.py"
    mine = lab_file.read_text().replace('raise NotImplementedError("Lab 1.1: Scale a list")', "return []")
    lab_file.write_text(mine)
    src_file = repo / "src" / "zero_offload" / "toy.py"
    src_file.write_text(TOY.replace("Do not modify xs.", "Do not modify xs, ever."))

    report = labkit.generate(repo)
    assert lab_file.read_text() == mine
    assert any("labs/lab1/toy.py" in note and "--force" in note for note in report.kept)
    assert "ever." in (repo / "solutions" / "lab1" / "toy.py").read_text()  # solutions always follow src
    assert labkit.generate(repo, check=True).ok  # an edit by the learner is not a difference

    labkit.generate(repo, force=True)
    assert lab_file.read_text() == labkit.render_stub(src_file.read_text(), src_file, lab=1)


def test_an_untouched_stub_follows_src(repo):
    labkit.generate(repo)
    src_file = repo / "src" / "zero_offload" / "toy.py"
    src_file.write_text(TOY.replace("Do not modify xs.", "Do not modify xs, ever."))
    assert "labs/lab1/toy.py (out of date)" in labkit.generate(repo, check=True).changes
    labkit.generate(repo)
    assert "ever." in (repo / "labs" / "lab1" / "toy.py").read_text()


def test_check_reports_edited_missing_and_stale_files(repo):
    labkit.generate(repo)
    (repo / "solutions" / "lab1" / "toy.py").write_text("edited by hand\n")
    (repo / "labs" / "lab4" / "kern.c").unlink()
    (repo / "src" / "zero_offload" / "sub" / "deep.py").write_text("def shift(xs, k):\n    return xs\n")
    report = labkit.generate(repo, check=True)
    assert set(report.changes) == {
        "solutions/lab1/toy.py (out of date)",
        "labs/lab4/kern.c (missing)",
        "solutions/lab1/sub/deep.py (stale)",
        "labs/lab1/sub/deep.py (stale)",
        "labs/lab1/.generated.json (out of date)",
        "solutions/lab2/sub/deep.py (stale)",
        "labs/lab2/sub/deep.py (stale)",
        "labs/lab2/.generated.json (stale)",
    }
    labkit.generate(repo)
    assert not (repo / "labs" / "lab2" / "sub" / "deep.py").exists()
    assert labkit.generate(repo, check=True).ok


def test_make_labs_cli_check_and_regenerate(repo):
    def make_labs(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, str(REPO / "tools" / "make_labs.py"), "--repo", str(repo), *args]
        return subprocess.run(command, capture_output=True, text=True)

    checked = make_labs("--check")
    assert checked.returncode == 1 and "labs/lab1/toy.py (missing)" in checked.stdout
    assert make_labs().returncode == 0
    assert make_labs("--check").returncode == 0
    _write(repo / "src" / "zero_offload" / "toy.py", TOY + "def g():\n    # BEGIN LAB 1.4: t\n    pass\n")
    failed = make_labs("--check")
    assert failed.returncode == 2 and "toy.py:" in failed.stderr and "has no END LAB 1.4" in failed.stderr


# --- the grader, end to end on a toy lab 1 ----------------------------------------------------------

TOY_TESTS = """\
import pytest

from zero_offload.sub.deep import shift
from zero_offload.toy import Counter, scale

pytestmark = pytest.mark.lab1


@pytest.mark.task("1.1")
def test_scale():
    assert scale([1, 2], 3) == [3, 6]


@pytest.mark.task("1.2")
def test_counter():
    assert Counter().bump(2).bump(3).total == 5


@pytest.mark.task("1.3")
def test_shift():
    assert shift([1, 2, 3], 1) == [2, 3, 1]


@pytest.mark.task("1.3")
@pytest.mark.skip(reason="a skipped test does not count as passed")
def test_skipped():
    pass
"""


@pytest.fixture
def graded_repo(repo: Path) -> Path:
    """The toy package, plus the real grading code, and graded tests for tasks 1.1-1.3 (none for 1.4)."""
    grade = repo / "src" / "zero_offload" / "cli" / "grade"
    for name in ("__init__.py", "labkit.py", "labs.py", "run.py", "report.py", "plugin.py"):
        _write(grade / name, Path(grading.__file__).with_name(name).read_text(encoding="utf-8"))
    _write(grade.parent / "__init__.py", "")
    _write(repo / "tests" / "course" / "labs" / "__init__.py", "")
    _write(repo / "tests" / "course" / "labs" / "test_toy.py", TOY_TESTS)
    markers = "\n    ".join(["lab1: graded", "task(id): the task"])
    _write(repo / "pytest.ini", f"[pytest]\naddopts = --strict-markers\nmarkers =\n    {markers}\n")
    labkit.generate(repo)
    return repo


def _grade(repo: Path, *args: str) -> subprocess.CompletedProcess:
    # A fresh interpreter whose zero_offload is the toy package: grading locates the package and the
    # repository from zero_offload's own path, as it does for the course.
    env = {**os.environ, "PYTHONPATH": str(repo / "src")}
    # `zo grade`'s own options and run, without the rest of `zo` (the toy package has no cli/main.py).
    code = (
        "import argparse, sys; from zero_offload.cli.grade import run; parser = argparse.ArgumentParser(); "
        "run.add_arguments(parser); sys.exit(run.run(parser.parse_args(sys.argv[1:])))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=repo, env=env, capture_output=True, text=True
    )


def test_grading_the_stubs_fails_every_task(graded_repo):
    run = _grade(graded_repo, "1")
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert any(
        line.startswith("1.1 ") and "| FAIL " in line and "NotImplementedError: Lab 1.1" in line
        for line in lines
    )
    assert any(line.startswith("1.4 ") and "NO TESTS" in line for line in lines)
    assert "Lab 1: 0 of 4 tasks passed, 0 / 100 points" in lines
    assert max(grading_report.display_width(line) for line in lines) <= grading_report.WIDTH


def test_grading_the_solutions_counts_passed_skipped_and_missing_tests(graded_repo):
    run = _grade(graded_repo, "1", "--lab-dir", "solutions")
    assert run.returncode == 1, run.stdout + run.stderr
    rows = {line[:3]: line for line in run.stdout.splitlines() if line[:3] in ("1.1", "1.2", "1.3", "1.4")}
    assert "| PASS" in rows["1.1"] and "| PASS" in rows["1.2"]
    assert "| FAIL" in rows["1.3"] and "skipped: a skipped test" in rows["1.3"]
    assert "| NO TESTS" in rows["1.4"]
    assert "Lab 1: 2 of 4 tasks passed, 50 / 100 points" in run.stdout


def test_grading_swaps_in_only_the_labs_files_and_names_missing_ones(graded_repo):
    lab_dir = graded_repo / "mine"
    labkit.write_lab(graded_repo / "src" / "zero_offload", 1, lab_dir, solution=True)
    _write(lab_dir / "plain.py", "this is not python\n")  # not a lab 1 file: never copied
    run = _grade(graded_repo, "1", "--lab-dir", str(lab_dir))
    assert "Lab 1: 2 of 4 tasks passed" in run.stdout, run.stdout + run.stderr
    (lab_dir / "toy.py").unlink()
    run = _grade(graded_repo, "1", "--lab-dir", str(lab_dir))
    assert run.returncode == 2 and "lacks lab 1's files: toy.py" in run.stderr


def test_grading_plugin_refuses_a_package_outside_the_overlay(graded_repo, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(graded_repo / "src"), "ZO_GRADING_LAB": "1"}
    env.update(ZO_GRADING_OVERLAY=str(tmp_path / "elsewhere"), ZO_GRADING_RESULTS=str(tmp_path / "r.json"))
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "zero_offload.cli.grade.plugin",
        "-p",
        "no:cacheprovider",
    ]
    run = subprocess.run(
        [*command, "tests/course/labs"], cwd=graded_repo, env=env, capture_output=True, text=True
    )
    assert run.returncode == 4 and "not from the grading copy" in run.stderr


def test_unknown_and_unavailable_labs_exit_2(capsys, monkeypatch):
    assert zo_main(["grade", "9"]) == 2
    assert "there is no lab 9" in capsys.readouterr().err
    # Every lab is released now; a course that adds a module releases its lab later, and says so until then.
    lab5 = dataclasses.replace(grading.LABS[5], available=False)
    monkeypatch.setitem(grading.LABS, 5, lab5)
    assert zo_main(["grade", "5"]) == 2
    assert "is not available yet" in capsys.readouterr().err


def test_registry_points_add_up_to_100():
    for lab in grading.LABS.values():
        assert sum(t.points for t in lab.tasks) == 100, lab.number
        assert [t.id for t in lab.tasks] == [f"{lab.number}.{i}" for i in range(1, len(lab.tasks) + 1)]
