"""tools/figures/systems.py: every plotted system has a citation to a paper, the points are the module's table,
and chapter 6 shows the figure and quotes the same numbers."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from tools.figures import systems

REPO = Path(__file__).resolve().parents[2]


def test_every_claim_cites_its_paper():
    for claim in systems.CLAIMS:
        assert claim.arxiv in claim.citation, claim.system
        assert claim.setting in systems.COLOURS, claim.system
        assert claim.billions > 0 and claim.hardware


def test_systems_without_a_size_say_why():
    plotted = {claim.system for claim in systems.CLAIMS}
    for system, reason in systems.NOT_PLOTTED.items():
        assert system not in plotted
        assert len(reason) > 20


@pytest.mark.parametrize(("arxiv", "year"), [("2101.06840", 2021.0), ("2509.21271", 2025 + 8 / 12)])
def test_x_is_the_month_of_the_first_version(arxiv, year):
    assert systems.year_of(arxiv) == pytest.approx(year)


def test_the_points_drawn_are_the_table(tmp_path, monkeypatch):
    drawn = []
    real = plt.Axes.scatter

    def record(self, x, y, *args, **kwargs):
        drawn.append((x, y))
        return real(self, x, y, *args, **kwargs)

    monkeypatch.setattr(plt.Axes, "scatter", record)
    systems.draw_systems(tmp_path / "systems.png")
    assert drawn == [(systems.year_of(c.arxiv), c.billions) for c in systems.CLAIMS]


def test_chapter_6_shows_the_figure_and_its_numbers():
    text = (REPO / "course" / "06-state-of-the-art.md").read_text(encoding="utf-8")
    assert "figures/offload-systems.png" in text
    for claim in systems.CLAIMS:
        assert claim.system.split(" ")[0] in text, claim.system
