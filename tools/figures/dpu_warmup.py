"""Chapter 6A's measured figure, read from a committed output (no number is typed in here):

- dpu-warmup.png: how long the delayed parameter update (DPU) should wait. Training loss against step for no DPU
                  and each `start_step` of course/measured/dpu-warmup.json (written by
                  tools/measure_dpu_warmup.py: TinyGPT "tiny", 300 steps, three seeds): the mean over the seeds as
                  a thick line, each seed as a thin one, a dashed marker at each start step; beside it the
                  validation loss after the last step per setting (the mean as a bar, each seed as a dot).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt

from .style import CPU, EDGE, GPU, INK, LINK, save

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "course" / "measured" / "dpu-warmup.json"
# One colour per setting, in the json's order: no DPU first, then the start steps from the earliest.
COLORS = (INK, LINK, CPU, GPU, EDGE)


@dataclass(frozen=True)
class Setting:
    name: str  # the json's summary key: "no DPU", "start_step 10", ...
    start_step: int | None
    seeds: tuple[int, ...]
    losses: tuple[tuple[float, ...], ...]  # per seed, in `seeds` order: the training loss of every step
    val_losses: tuple[float, ...]  # per seed: the validation loss after the last step
    val_mean: float  # the json's mean of `val_losses`

    @property
    def mean(self) -> tuple[float, ...]:
        """The training loss of each step, mean over the seeds."""
        return tuple(statistics.fmean(step) for step in zip(*self.losses, strict=True))


def settings(path: Path = SOURCE) -> list[Setting]:
    """Every setting of the json's summary, in its order, with every run of that setting."""
    result = json.loads(path.read_text(encoding="utf-8"))
    out = []
    for name, row in result["summary"].items():
        runs = {r["seed"]: r for r in result["runs"] if r["start_step"] == row["start_step"]}
        seeds = tuple(row["seeds"])
        if sorted(runs) != sorted(seeds):
            raise ValueError(f"{name}: the runs' seeds {sorted(runs)} are not the summary's {seeds}")
        out.append(
            Setting(
                name=name,
                start_step=row["start_step"],
                seeds=seeds,
                losses=tuple(tuple(runs[s]["losses"]) for s in seeds),
                val_losses=tuple(runs[s]["val_loss"] for s in seeds),
                val_mean=row["val_mean"],
            )
        )
    return out


def draw_dpu_warmup(path: Path) -> Path:
    data = settings()
    fig, (ax, bar) = plt.subplots(1, 2, figsize=(11, 5), gridspec_kw={"width_ratios": (2.6, 1)})
    for k, (setting, color) in enumerate(zip(data, COLORS, strict=False)):
        steps = range(len(setting.mean))
        for losses in setting.losses:
            ax.plot(steps, losses, color=color, linewidth=0.5, alpha=0.3)
        ax.plot(steps, setting.mean, color=color, linewidth=1.8, label=f"{setting.name} (mean of seeds)")
        if setting.start_step is not None:
            ax.axvline(setting.start_step, color=color, linestyle="--", linewidth=1.1)
            ax.annotate(
                f"start {setting.start_step}",
                (setting.start_step, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -12 * k),  # one row per setting: the labels of 0 and 10 do not overlap
                textcoords="offset points",
                fontsize=8,
                color=color,
            )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (thin: each seed)")
    ax.set_xlim(-4, len(data[0].mean) - 1)  # the marker at step 0 clear of the frame
    ax.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 0.9))
    ax.set_title("training loss: the later the delay starts, the closer to no DPU", fontsize=10)

    ys = range(len(data))
    colors = [color for _, color in zip(data, COLORS, strict=False)]
    bar.barh(ys, [s.val_mean for s in data], color=colors, alpha=0.35, edgecolor=EDGE)
    for y, setting, color in zip(ys, data, colors, strict=True):
        bar.plot(setting.val_losses, [y] * len(setting.val_losses), "o", color=color, markersize=4)
        bar.text(setting.val_mean + 0.05, y + 0.28, f"{setting.val_mean:.4f}", fontsize=8, va="center")
    bar.set_yticks(list(ys), [s.name for s in data], fontsize=8)
    bar.invert_yaxis()  # no DPU on top, as in the chapter's table
    bar.set_xlim(0, max(max(s.val_losses) for s in data) * 1.25)
    bar.set_xlabel("validation loss after the last step")
    bar.set_title("final validation loss (dots: each seed)", fontsize=10)
    fig.suptitle(
        "Delayed parameter update, TinyGPT tiny, seeds "
        + ", ".join(map(str, data[0].seeds))
        + ": course/measured/dpu-warmup.json",
        fontsize=10,
    )
    fig.tight_layout()
    return save(fig, path)


FIGURES = {"dpu-warmup.png": draw_dpu_warmup}
