"""tools/draw_figures.py: it writes every figure of tools/figures/ as a PNG of a readable size, without the
network, and a second run writes the same bytes (nothing random, nothing dated in the files)."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import pytest

from tools import draw_figures
from tools.figures import collect, concepts

REPO = Path(__file__).resolve().parents[2]
NAMES = tuple(collect())
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, which a PNG must put first."""
    assert data[:8] == PNG_SIGNATURE, "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def draw():
    return concepts


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    """Two runs into two folders, with every socket refused: the script must not need the network."""
    outs = [tmp_path_factory.mktemp("figures-a"), tmp_path_factory.mktemp("figures-b")]

    def refuse(*args, **kwargs):
        raise AssertionError("draw_figures.py opened a socket")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket, "socket", refuse)
        patch.setattr(socket, "create_connection", refuse)
        for out in outs:
            assert draw_figures.main(["--out", str(out)]) == 0
    return outs


def test_each_figure_is_a_png_of_sensible_size(figures):
    for name in NAMES:
        path = figures[0] / name
        assert path.is_file(), f"{name} was not written"
        data = path.read_bytes()
        width, height = _png_size(data)
        # about 10 x 4..7 inches at 150 dpi: readable at 100 % zoom, not a poster
        assert 1200 <= width <= 1800, (name, width)
        assert 500 <= height <= 1100, (name, height)
        assert 20_000 <= len(data) <= 2_000_000, (name, len(data))


def test_the_script_writes_only_the_figures(figures):
    assert sorted(p.name for p in figures[0].iterdir()) == sorted(NAMES)


def test_the_committed_figures_are_the_ones_drawn(figures):
    """course/figures/ holds what the tools draw today: a figure edited by hand, or not redrawn after its data
    changed, differs here."""
    for name in NAMES:
        committed = REPO / "course" / "figures" / name
        assert committed.is_file(), f"{name} is drawn but not committed: run python -m tools.draw_figures"
        assert committed.read_bytes() == (figures[0] / name).read_bytes(), (
            f"{name} differs from what is drawn"
        )


def test_a_second_run_writes_the_same_bytes(figures):
    for name in NAMES:
        assert (figures[0] / name).read_bytes() == (figures[1] / name).read_bytes(), name


def test_the_annotated_bytes_are_the_estimators(draw):
    # The figure's formulas, per GPU and per parameter, at N = 4; the script also checks them as it draws.
    assert [draw.bytes_per_param(stage)["device"] for stage in range(4)] == [16, 7, 5.5, 4]
    assert draw.bytes_per_param(2, offload=True) == {"device": 2, "host": 4}


def test_the_schedules_order_as_the_chapter_says(draw):
    # Illustrative durations, but the shape must hold: the pipeline's step is shorter than the serial one and
    # the delayed update's shorter still; each unit's Adam starts only after its D2H has landed.
    def step_length(gantt):
        return gantt.steps[2] - gantt.steps[1]

    serial, pipeline, dpu = draw.serial_schedule(3), draw.pipeline_schedule(3), draw.dpu_schedule(3)
    assert step_length(dpu) < step_length(pipeline) < step_length(serial)
    landed = {
        label: start + length
        for lane, start, length, label, step in pipeline.blocks
        if lane == "D2H" and step == 0
    }
    for lane, start, _, label, step in pipeline.blocks:
        if lane == "host Adam" and step == 0:
            assert start >= landed[label[1:]] - 1e-9
