"""Chapter 4's training figure, read from a committed output (no number is typed in here):

- moment-convergence.png: the training loss of fp32, bf16 and 8-bit Adam moments on the host, per workload of
                          course/measured/moment-convergence.json (written by tools/measure_moment_convergence.py:
                          TinyGPT, TinyGPT in fp16 with loss scaling, the Llama example; three seeds each): the mean
                          over the seeds, averaged over the last 20 steps (a trailing window), with each setting's
                          final validation loss (the json's mean of seeds) in the legend.

tools/measure_moment_convergence.py draws the same figure with `draw_result` after it measures (or with --print).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import matplotlib.pyplot as plt

from .style import CPU, INK, LINK, save

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "course" / "measured" / "moment-convergence.json"
PRECISIONS = ("fp32", "bf16", "int8")
COLORS = {"fp32": INK, "bf16": CPU, "int8": LINK}
WINDOW = 20  # steps in the trailing average


def smoothed_means(result: dict, workload: str, precision: str, window: int = WINDOW) -> list[float]:
    """The training loss of each step, mean over the seeds, then averaged over the `window` steps up to it."""
    runs = [r for r in result["runs"] if r["workload"] == workload and r["precision"] == precision]
    if not runs:
        return []
    steps = len(runs[0]["losses"])
    mean = [statistics.fmean(r["losses"][i] for r in runs) for i in range(steps)]
    return [statistics.fmean(mean[max(0, i - window + 1) : i + 1]) for i in range(steps)]


def draw_result(result: dict, path: Path) -> Path:
    workloads = list(result["summary"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(11, 4.2), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        for precision in PRECISIONS:
            smooth = smoothed_means(result, workload, precision)
            if not smooth:
                continue
            final = result["summary"][workload][precision]["val_mean"]
            ax.plot(
                range(1, len(smooth) + 1),
                smooth,
                color=COLORS[precision],
                linewidth=1.3,
                label=f"{precision} moments (val {final:.3f})",
            )
        ax.set_title(workload, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(f"train loss, mean of seeds, {WINDOW}-step average", fontsize=8)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return save(fig, path)


def draw_moment_convergence(path: Path) -> Path:
    return draw_result(json.loads(SOURCE.read_text(encoding="utf-8")), path)


FIGURES = {"moment-convergence.png": draw_moment_convergence}
