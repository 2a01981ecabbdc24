"""gradient-path.png: the path of one gradient through the engine's files, serial and pipelined.

Drawn from the trace of `tools/gradient_walk.py` (stage 2 with the optimizer offloaded, the nano TinyGPT, one
step): for each landmark (the gradient reaching the host, the host's Adam, the new weights going back to the
device) the tool records the chain of project functions on the stack, outermost first. Here the chains of one
run are merged where they share their start (a prefix tree), each function is a node, each call a hop (an
arrow), and consecutive functions of one file sit in one box labelled with the file.

Colours say where the work of a node happens, by a rule stated here and nowhere else:
- the landmark nodes of "to the host" and "back to the device" are the PCIe copies (D2H, H2D);
- the nodes that lead to the gradient's copy (backward, the buckets, the reduce-scatter) are device-side work;
- every other node is the host's: the optimizer step, the updater, the CPU Adam, the pipeline's host queue.

Nothing is typed in: a renamed function or a new hop changes the figure at its next drawing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

from tools import gradient_walk

from .style import CPU, CPU_LIGHT, EDGE, GPU, GPU_LIGHT, INK, LINK, LINK_LIGHT, save

TO_HOST, ADAM, BACK = gradient_walk.LANDMARKS  # the tool's landmarks, in the order it reports them
MODES = (("serial offloaded step (stage 2 + offload_optimizer)", False), ("overlapped pipeline", True))
PLACE_COLOURS = {"device": (GPU, GPU_LIGHT), "pcie": (LINK, LINK_LIGHT), "host": (CPU, CPU_LIGHT)}
TAGS = {TO_HOST: "D2H: gradient to the host", ADAM: "CPU Adam", BACK: "H2D: weights back"}


@cache
def traces() -> dict[bool, dict[str, tuple[str, ...]]]:
    """The tool's chains for the serial path (False) and the pipeline (True), as `file:function` tuples."""
    return {
        overlap: {landmark: tuple(chain) for landmark, chain in gradient_walk.walk(overlap).items()}
        for _, overlap in MODES
    }


@dataclass(frozen=True)
class Node:
    prefix: tuple[str, ...]  # the chain up to and including this function: its identity in the tree
    column: int  # depth in the call chain
    row: int
    place: str  # "device", "pcie" or "host"
    tag: str = ""  # the landmark reached here, if any

    @property
    def file(self) -> str:
        return self.prefix[-1].split(":")[0]

    @property
    def function(self) -> str:
        return self.prefix[-1].split(":", 1)[1]


def tree(chains: dict[str, tuple[str, ...]]) -> tuple[list[Node], list[tuple[Node, Node]]]:
    """The chains merged into one prefix tree: its nodes, and its hops (parent, child).

    A new node continues its parent's row when it is the parent's first child, and opens a row below otherwise.
    """
    nodes: dict[tuple[str, ...], Node] = {}
    children: dict[tuple[str, ...], int] = {}
    hops: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    rows = 0
    for landmark in gradient_walk.LANDMARKS:
        chain = chains[landmark]
        for depth in range(len(chain)):
            prefix = chain[: depth + 1]
            if prefix in nodes:
                continue
            parent = prefix[:-1]
            if parent and children.get(parent, 0) == 0:
                row = nodes[parent].row
            else:
                row, rows = rows, rows + 1
            if parent:
                children[parent] = children.get(parent, 0) + 1
                hops.append((parent, prefix))
            nodes[prefix] = Node(prefix, depth, row, "host")
    # Places and tags, from the rule in the module's docstring.
    to_host = chains[TO_HOST]
    for prefix, node in list(nodes.items()):
        place = "device" if to_host[: len(prefix)] == prefix else "host"
        tags = [landmark for landmark in gradient_walk.LANDMARKS if chains[landmark] == prefix]
        if any(landmark in (TO_HOST, BACK) for landmark in tags):
            place = "pcie"
        nodes[prefix] = Node(prefix, node.column, node.row, place, " / ".join(TAGS[t] for t in tags))
    return list(nodes.values()), [(nodes[a], nodes[b]) for a, b in hops]


def walk_summary(chains: dict[str, tuple[str, ...]]) -> tuple[int, int]:
    """(hops, files) as the tool counts them: hops summed over the walks, files on any of them."""
    hops = sum(len(chain) - 1 for chain in chains.values())
    files = {step.split(":")[0] for chain in chains.values() for step in chain}
    return hops, len(files)


COLUMN_W, BOX_W, BOX_H, ROW_H = 1.28, 1.12, 0.34, 0.86
LEFT = 0.25


def _xy(node: Node, top: float) -> tuple[float, float]:
    """The centre of a node's box."""
    return LEFT + node.column * COLUMN_W + BOX_W / 2, top - node.row * ROW_H


def _draw_panel(ax, title: str, chains: dict[str, tuple[str, ...]], top: float) -> float:
    """One mode's tree, its first row centred at `top`; returns the lowest y it used."""
    nodes, hops = tree(chains)
    hop_count, file_count = walk_summary(chains)
    ax.text(
        LEFT - 0.1,
        top + 0.62,
        f"{title}: {hop_count} hops over {len(chains)} walks, {file_count} files",
        fontsize=10,
        weight="bold",
        va="center",
    )
    # One box per run of consecutive functions of one file in a row.
    by_row: dict[int, list[Node]] = {}
    for node in sorted(nodes, key=lambda n: (n.row, n.column)):
        by_row.setdefault(node.row, []).append(node)
    for row_nodes in by_row.values():
        runs: list[list[Node]] = []
        for node in row_nodes:
            if runs and runs[-1][-1].file == node.file and runs[-1][-1].column + 1 == node.column:
                runs[-1].append(node)
            else:
                runs.append([node])
        for run in runs:
            x0 = _xy(run[0], top)[0] - BOX_W / 2 - 0.05
            x1 = _xy(run[-1], top)[0] + BOX_W / 2 + 0.05
            y = _xy(run[0], top)[1]
            ax.add_patch(
                FancyBboxPatch(
                    (x0, y - BOX_H / 2 - 0.06),
                    x1 - x0,
                    BOX_H + 0.3,
                    boxstyle="round,pad=0,rounding_size=0.06",
                    facecolor="#f3f3f3",
                    edgecolor=EDGE,
                    linewidth=0.7,
                    zorder=1,
                )
            )
            ax.text(
                x0 + 0.06, y + BOX_H / 2 + 0.13, run[0].file, fontsize=6, color=INK, va="center", zorder=2
            )
    for node in nodes:
        x, y = _xy(node, top)
        edge, fill = PLACE_COLOURS[node.place]
        ax.add_patch(
            FancyBboxPatch(
                (x - BOX_W / 2, y - BOX_H / 2),
                BOX_W,
                BOX_H,
                boxstyle="round,pad=0,rounding_size=0.05",
                facecolor=fill,
                edgecolor=edge,
                linewidth=2.0 if node.tag else 0.9,
                zorder=3,
            )
        )
        ax.text(x, y, node.function, ha="center", va="center", fontsize=7, family="monospace", zorder=4)
        if node.tag:
            ax.text(
                x, y - BOX_H / 2 - 0.1, node.tag, ha="center", va="center", fontsize=6.5, color=edge, zorder=4
            )
    for parent, child in hops:
        (x0, y0), (x1, y1) = _xy(parent, top), _xy(child, top)
        colour = PLACE_COLOURS[child.place][0]
        start = (x0 + BOX_W / 2, y0) if y0 == y1 else (x0, y0 - BOX_H / 2)
        end = (x1 - BOX_W / 2, y1)
        ax.add_patch(
            FancyArrowPatch(
                start,
                end,
                arrowstyle="-|>",
                mutation_scale=9,
                color=colour,
                linewidth=1.1,
                connectionstyle="arc3,rad=0" if y0 == y1 else "angle,angleA=-90,angleB=0,rad=0.08",
                zorder=5,
            )
        )
    return top - max(node.row for node in nodes) * ROW_H - BOX_H / 2


def figure(chains_by_mode: dict[bool, dict[str, tuple[str, ...]]]):
    """The figure for these traces (a matplotlib Figure, not yet saved)."""
    width, height = 12.0, 6.4
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    ax.text(
        width / 2,
        height - 0.25,
        "One gradient through the engine's files: the call chains tools/gradient_walk.py records (nano TinyGPT)",
        ha="center",
        va="center",
        fontsize=11,
        weight="bold",
    )
    top = height - 1.35
    for title, overlap in MODES:
        bottom = _draw_panel(ax, title, chains_by_mode[overlap], top)
        top = bottom - 1.25
    ax.legend(
        handles=[
            Patch(facecolor=GPU_LIGHT, edgecolor=GPU, label="device side: backward, buckets, reduce-scatter"),
            Patch(facecolor=LINK_LIGHT, edgecolor=LINK, label="PCIe copy: D2H gradient shard, H2D weights"),
            Patch(facecolor=CPU_LIGHT, edgecolor=CPU, label="host side: optimizer step, updater, CPU Adam"),
            Patch(facecolor="#f3f3f3", edgecolor=EDGE, label="one file, under src/zero_offload/"),
        ],
        loc="lower center",
        ncol=4,
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(0.5, 0.0),
    )
    return fig


def draw_gradient_path(path: Path) -> Path:
    return save(figure(traces()), path)


FIGURES = {"gradient-path.png": draw_gradient_path}
