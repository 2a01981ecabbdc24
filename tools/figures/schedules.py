"""One measured step of each schedule (serial, overlapped, delayed/DPU), drawn from the lesson's stored output.

    measured-schedule-step.png   lessons/05_practice.ipynb, section 1: TinyGPT('10m'), batch 1 x 8, split cores,
                                 medians over 9 steps of each schedule of the step (wall), forward, backward,
                                 the host's Adam (CPU busy) and the tail after backward

The notebook keeps phase medians, not the start and end of every span, so each step is drawn as stacked
phase bars from those medians: on the device's lane forward, backward and the tail after backward (the device
waiting) one after another; on the host's lane one bar as long as the host's Adam was busy, placed in the
phase it ran beside (serial: after backward; overlapped: beside backward; DPU: beside forward and backward,
it is the previous step's update). The host bar says how long and beside what, not its exact start: in the
overlapped and delayed steps that work is spread over many units. A marker shows each step's median wall time;
the medians are taken per column, so the stacked bars need not add up to it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from .style import CPU, EDGE, GPU, GPU_LIGHT, HOLLOW, INK, save

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "lessons" / "05_practice.ipynb"
HEADER = "schedule         step (wall)  forward  backward  CPU Adam  tail after backward"
SCHEDULES = ("serial", "overlapped", "delayed (DPU)")
ROW = re.compile(
    r"^(serial|overlapped|delayed \(DPU\))\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$"
)


def _outputs(path: Path) -> list[str]:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    texts = []
    for cell in cells:
        for output in cell.get("outputs", []):
            text = output.get("text", output.get("data", {}).get("text/plain", ""))
            texts.append(text if isinstance(text, str) else "".join(text))
    return texts


def phase_medians(path: Path = NOTEBOOK) -> dict[str, dict[str, float]]:
    """{schedule: {"step", "forward", "backward", "adam", "tail"}} in ms, from the notebook's split-cores table."""
    tables = [t for t in _outputs(path) if HEADER in t and "split cores" in t]
    if len(tables) != 1:
        raise ValueError(f"{path}: expected one split-cores phase table, found {len(tables)}")
    found = {}
    for line in tables[0].splitlines():
        if m := ROW.match(line.strip()):
            values = [float(v) for v in m.groups()[1:]]
            found[m.group(1)] = dict(
                zip(("step", "forward", "backward", "adam", "tail"), values, strict=True)
            )
    if tuple(found) != SCHEDULES:
        raise ValueError(f"{path}: the phase table holds {list(found)}, not {list(SCHEDULES)}")
    return found


def step_bars(phases: dict[str, float], schedule: str) -> dict[str, list[tuple[str, float, float]]]:
    """(label, start, length) in ms of each bar of one step, by lane ("device", "host")."""
    f, b, tail = phases["forward"], phases["backward"], phases["tail"]
    device = [("forward", 0.0, f), ("backward", f, b), ("tail (device waits)", f + b, tail)]
    start = {"serial": f + b, "overlapped": f, "delayed (DPU)": 0.0}[schedule]
    return {"device": device, "host": [("Adam (busy)", start, phases["adam"])]}


COLORS = {"forward": GPU_LIGHT, "backward": GPU, "tail (device waits)": HOLLOW, "Adam (busy)": CPU}


def draw_measured_schedule_step(path: Path) -> Path:
    medians = phase_medians()
    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(10, 5.6))
    longest = max(max(p["step"], p["forward"] + p["backward"] + p["tail"]) for p in medians.values())
    for ax, schedule in zip(axes, SCHEDULES, strict=True):
        phases = medians[schedule]
        for lane, bars in enumerate(step_bars(phases, schedule).values()):
            for label, start, length in bars:
                ax.broken_barh(
                    [(start, length)],
                    (lane - 0.35, 0.7),
                    facecolor=COLORS[label],
                    edgecolor=EDGE,
                    hatch="//" if label.startswith("tail") else None,
                )
                text_color = "white" if COLORS[label] in (GPU, CPU) else INK
                ax.text(start + length / 2, lane, f"{length:.1f}", ha="center", va="center", fontsize=8,
                        color=text_color)  # fmt: skip
        ax.axvline(phases["step"], color=INK, linestyle="--", linewidth=1)
        ax.text(phases["step"] + 0.3, 1.45, f"step {phases['step']:.1f} ms", fontsize=8, va="center")
        ax.set_yticks([0, 1], ["device", "host"], fontsize=9)
        ax.set_ylim(1.8, -0.6)
        ax.set_title(schedule, fontsize=10, loc="left")
    axes[-1].set_xlim(0, longest * 1.12)
    axes[-1].set_xlabel("time from the start of the step (ms); bar widths are the phase medians of 9 steps")
    fig.legend(
        handles=[
            Patch(facecolor=c, edgecolor=EDGE, hatch="//" if k.startswith("tail") else None, label=k)
            for k, c in COLORS.items()
        ],  # fmt: skip
        loc="upper left",
        bbox_to_anchor=(0.015, 0.955),
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    fig.suptitle("One step of each schedule, measured (TinyGPT 10m, batch 1 x 8, split cores)", x=0.02,
                 ha="left", fontsize=11)  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return save(fig, path)


FIGURES = {"measured-schedule-step.png": draw_measured_schedule_step}
