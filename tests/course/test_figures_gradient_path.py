"""gradient-path.png draws the path tools/gradient_walk.py traces: every hop of every walk is an arrow, every
arrow is a hop of some walk, every function and file on the way is labelled, and each landmark sits where the
walk ends, in the colour of what happens there."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest
from matplotlib.patches import FancyArrowPatch

from tools import gradient_walk
from tools.figures import gradient_path
from tools.figures.style import CPU, LINK


@pytest.fixture(scope="module")
def traced():
    """The tool's own walks, run here and not taken from the figure module."""
    return {overlap: gradient_walk.walk(overlap) for overlap in (False, True)}


def test_the_figure_draws_the_traces_of_the_tool(traced):
    drawn = gradient_path.traces()
    assert {mode: {k: list(v) for k, v in chains.items()} for mode, chains in drawn.items()} == traced


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_the_tree_has_exactly_the_hops_of_the_walks(traced, overlap):
    chains = {landmark: tuple(chain) for landmark, chain in traced[overlap].items()}
    nodes, hops = gradient_path.tree(chains)
    walked = {(chain[:i], chain[: i + 1]) for chain in chains.values() for i in range(1, len(chain))}
    assert {(a.prefix, b.prefix) for a, b in hops} == walked
    assert len(hops) == len(walked)  # each hop is drawn once, however many walks share it
    assert {n.prefix for n in nodes} == {
        chain[: i + 1] for chain in chains.values() for i in range(len(chain))
    }
    # The columns are the depths of the call chains, and no two nodes share a place.
    assert all(n.column == len(n.prefix) - 1 for n in nodes)
    assert len({(n.row, n.column) for n in nodes}) == len(nodes)
    # Each landmark is where its walk ends: PCIe for the copies, host for Adam.
    places = {n.prefix: n.place for n in nodes}
    assert places[chains[gradient_path.TO_HOST]] == "pcie"
    assert places[chains[gradient_path.BACK]] == "pcie"
    assert places[chains[gradient_path.ADAM]] == "host"
    assert places[chains[gradient_path.TO_HOST][:1]] == "device"  # backward starts on the device's side


def test_the_drawing_labels_each_function_and_file_and_draws_each_hop(traced):
    chains_by_mode = {mode: {k: tuple(v) for k, v in chains.items()} for mode, chains in traced.items()}
    fig = gradient_path.figure(chains_by_mode)
    try:
        (ax,) = fig.axes
        texts = [t.get_text() for t in ax.texts]
        arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
        colours = {tuple(round(c, 3) for c in a.get_edgecolor()[:3]) for a in arrows}
    finally:
        plt.close(fig)
    for chains in chains_by_mode.values():
        for chain in chains.values():
            for step in chain:
                path, function = step.split(":", 1)
                assert function in texts and path in texts, step
        hops, files = gradient_path.walk_summary(chains)
        assert any(f"{hops} hops" in t and f"{files} files" in t for t in texts)
    expected = sum(len(gradient_path.tree(chains)[1]) for chains in chains_by_mode.values())
    assert len(arrows) == expected
    rgb = {tuple(round(int(c[i : i + 2], 16) / 255, 3) for i in (1, 3, 5)) for c in (LINK, CPU)}
    assert rgb <= colours  # the copies and the host's hops are drawn in their colours
