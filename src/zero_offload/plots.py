"""Figures the demo, the lessons and the benchmarks save as files (English labels: see DESIGN.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: the demo runs on machines without a screen
import matplotlib.pyplot as plt  # noqa: E402

from .basics.memory import STATES, ModelStateBytes  # noqa: E402

STATE_LABELS = {
    "parameters": "weights (fp16/bf16, or fp32)",
    "gradients": "gradients",
    "master_weights": "fp32 master weights",
    "exp_avg": "Adam momentum (fp32)",
    "exp_avg_sq": "Adam variance (fp32)",
}


def save_figure(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def show(fig, path: str | Path) -> Path:
    """For the notebooks: save `fig` to `path` and display the saved file, so notebook and file are one picture."""
    from IPython.display import Image, display  # only the notebooks need IPython

    path = save_figure(fig, path)
    display(Image(filename=str(path)))
    return path


def plot_model_states(
    estimates: Mapping[str, ModelStateBytes],
    path: str | Path,
    *,
    title: str,
    tiers: Sequence[str] = ("device", "host"),
    unit: float = 1e9,
    unit_name: str = "GB",
    capacity: float | None = None,
) -> Path:
    """Stacked bars of model-state bytes per configuration, one panel per memory tier."""
    labels = list(estimates)
    fig, axes = plt.subplots(1, len(tiers), figsize=(5.2 * len(tiers), 4.2), sharey=True, squeeze=False)
    for ax, tier in zip(axes[0], tiers, strict=True):
        bottom = [0.0] * len(labels)
        for state in STATES:
            heights = [estimates[label].bytes[state][tier] / unit for label in labels]
            ax.bar(labels, heights, bottom=bottom, label=STATE_LABELS[state])
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        for x, total in enumerate(bottom):
            ax.text(
                x,
                total,
                f"{total:.0f}" if total >= 10 else f"{total:.2f}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        if capacity is not None and tier == "device":
            ax.axhline(capacity / unit, color="black", linestyle="--", linewidth=1, label="device capacity")
        ax.set_title(f"{tier} memory")
        ax.set_ylabel(unit_name)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.suptitle(title)
    return save_figure(fig, path)


LOSS_LABEL = "loss (cross-entropy, nats/byte)"


def plot_curves(
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    path: str | Path,
    *,
    title: str,
    ylabel: str,
    xlabel: str = "step",
) -> Path:
    """One line per label through its (x, y) points; a curve of few points (an eval every N steps) gets markers."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, (xs, ys) in curves.items():
        ax.plot(xs, ys, label=label, marker="o" if len(xs) <= 20 else None, markersize=4)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def plot_losses(series: Mapping[str, Sequence[float]], path: str | Path, *, title: str) -> Path:
    """Training loss against step (1, 2, ...), one line per run."""
    curves = {label: (range(1, len(losses) + 1), losses) for label, losses in series.items()}
    return plot_curves(curves, path, title=title, ylabel=LOSS_LABEL)


def plot_bars(
    values: Mapping[str, float],
    path: str | Path,
    *,
    title: str,
    ylabel: str,
    line: tuple[str, float] | None = None,
) -> Path:
    """One bar per label, its value printed on top (benchmarks); `line` draws a labelled level across them."""
    labels = list(values)
    fig, ax = plt.subplots(figsize=(max(6.4, 0.8 * len(labels)), 4.0))
    ax.bar(labels, [values[k] for k in labels], color="tab:blue")
    for x, label in enumerate(labels):
        ax.text(x, values[label], f"{values[label]:.1f}", ha="center", va="bottom", fontsize=8)
    if line is not None:
        ax.axhline(line[1], color="tab:red", linestyle="--", label=line[0])
        ax.legend(fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    return save_figure(fig, path)
