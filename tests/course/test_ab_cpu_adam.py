"""tools/ab_cpu_adam.py: it times each kernel it is given beside the fp32 step and the floor, refuses what it
cannot build alike, and the committed course/measured/ab-cpu-adam-amd-epyc-zen4.txt is its own output."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
    pytest.skip("no C compiler on this machine", allow_module_level=True)

from tools import ab_cpu_adam as tool  # noqa: E402
from zero_offload.tuning import build  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MEASURED = REPO / "course" / "measured" / "ab-cpu-adam-amd-epyc-zen4.txt"
ROW = re.compile(r"^   (\S+)\s+([\d.]+) ms\s+of floor\s+(\d+)%\s+vs fp32 ([\d.]+)x$")
HEAD = re.compile(r"^x(\d): fp32 step ([\d.]+) ms, (\w+) floor ([\d.]+) ms")


def test_two_kernels_side_by_side(tmp_path, capsys):
    copy = tmp_path / "copy.c"
    shutil.copy(build.SOURCE, copy)
    args = [str(build.SOURCE), str(copy), "--numel", "70000", "--rounds", "1", "--threads", "1", "2"]
    assert tool.main([*args, "--variant", "scalar"]) == 0
    printed = capsys.readouterr().out
    assert "variant scalar" in printed
    for threads in (1, 2):
        assert re.search(rf"^x{threads}: fp32 step [\d.]+ ms, int8 floor [\d.]+ ms", printed, re.M), printed
    rows = [ROW.match(line) for line in printed.splitlines()]
    assert [m.group(1) for m in rows if m] == [str(build.SOURCE), str(copy)] * 2, printed


def test_a_kernel_it_cannot_build_alike_is_refused(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="not a file, and git cannot show"):
        tool.kernel_source("no-such-revision-anywhere", tmp_path)
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the header comparison needs a revision")
    other = tmp_path / "cpu_adam.h"
    other.write_text(build.HEADER.read_text() + "\n/* another field */\n")
    monkeypatch.setattr(build, "HEADER", other)
    with pytest.raises(SystemExit, match="cpu_adam.h differs"):
        tool.kernel_source("HEAD", tmp_path)


def test_committed_rows_follow_from_their_times():
    # Every "of floor" is floor / ms and every "vs fp32" fp32 / ms, of the times printed with it.
    fp32 = floor = None
    rows = 0
    for line in MEASURED.read_text().splitlines():
        if head := HEAD.match(line):
            fp32, floor = float(head.group(2)), float(head.group(4))
        elif row := ROW.match(line):
            ms = float(row.group(2))
            assert abs(100 * floor / ms - int(row.group(3))) <= 1.01, line
            assert abs(fp32 / ms - float(row.group(4))) <= 0.011, line
            rows += 1
    assert rows == 8 * 2 * 2, "eight runs, two thread counts, two kernels"
