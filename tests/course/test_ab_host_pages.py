"""tools/ab_host_pages.py: it times the same step on malloc's pages and on host_pages in the same rounds, and the
committed course/measured/host-pages-amd-epyc-zen4.txt is its own output."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
    pytest.skip("no C compiler on this machine", allow_module_level=True)

from tools import ab_host_pages as tool  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MEASURED = REPO / "course" / "measured" / "host-pages-amd-epyc-zen4.txt"
ROW = re.compile(
    r"^x(\d) (\w+)\s+(malloc|host pages)\s+fp32 step\s+([\d.]+) ms\s+\w+ step\s+([\d.]+) ms\s+floor\s+([\d.]+) ms"
    r"\s+of floor\s+(\d+)%\s+vs fp32 ([\d.]+)x$"
)
PAIRED = re.compile(
    r"^   host pages / malloc, median of per-round ratios: fp32 step [\d.]+  \w+ step [\d.]+  \w+ floor [\d.]+$"
)


def test_both_placements_side_by_side(capsys):
    args = ["--numel", "70000", "--rounds", "2", "--threads", "1", "2", "--precision", "int8", "bf16"]
    assert tool.main([*args, "--variant", "scalar"]) == 0
    printed = capsys.readouterr().out
    rows = [m.group(1, 2, 3) for m in map(ROW.match, printed.splitlines()) if m]
    assert rows == [
        (t, p, placement) for t in "12" for p in ("int8", "bf16") for placement in ("malloc", "host pages")
    ], printed
    assert sum(bool(PAIRED.match(line)) for line in printed.splitlines()) == 4, printed


def test_the_two_placements_are_what_they_say():
    from zero_offload.accelerator.host_allocator import HUGE_PAGE, STAGGER_SPAN

    zeros, state_of = tool.PLACEMENTS["host pages"]
    arrays = [zeros(2**22), *state_of(2**22, "int8").values()]
    assert all(a.data_ptr() % HUGE_PAGE < STAGGER_SPAN for a in arrays[:3])  # the 4 MiB ones: own pages
    assert not any(a.any() for a in arrays)


def test_committed_rows_follow_from_their_times():
    rows = 0
    for line in MEASURED.read_text().splitlines():
        if row := ROW.match(line):
            fp32, step, floor = (float(row.group(k)) for k in (4, 5, 6))
            assert abs(100 * floor / step - int(row.group(7))) <= 1.01, line
            assert abs(fp32 / step - float(row.group(8))) <= 0.011, line
            rows += 1
    assert rows > 0 and rows % 8 == 0, "each run: two thread counts, two precisions, two placements"
