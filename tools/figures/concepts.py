"""The course's three explanatory figures, drawn from fixed numbers:

- zero-stages.png:       what each of 4 GPUs holds of the model states at ZeRO stages 0-3 and at stage 2 with
                         the optimizer offloaded to the CPU, with bytes per parameter from basics/memory.py;
- offload-dataflow.png:  one ZeRO-Offload step as a data-flow graph (Ren et al., 2021, section 3): which node runs
                         where and how many bytes cross PCIe;
- pipeline-schedule.png: Gantt charts of the serial step, the overlapped pipeline and the delayed parameter
                         update on 4 units (illustrative durations, not measured).

They use no randomness, no network and no measurement, so a re-run writes the same files.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch, Rectangle

from zero_offload.basics.memory import estimate_model_states

from .style import CPU, CPU_LIGHT, EDGE, GPU, GPU_LIGHT, HOLLOW, INK, LINK, LINK_LIGHT, canvas, save

N = 4  # GPUs (ranks) in the ZeRO figure
UNITS = 4  # units in the pipeline figure


# ---------------------------------------------------------------------------------------------------------------
# 1. ZeRO stages


def bytes_per_param(stage: int, offload: bool = False) -> dict[str, float]:
    """Bytes per parameter on one rank of N, per tier, from the estimator the engine reports against."""
    num_params = N * 1_000_000  # a multiple of N: no shard rounding
    states = estimate_model_states(
        num_params, stage=stage, world_size=N, offload_optimizer="cpu" if offload else "none"
    )
    return {tier: states.tier(tier) / num_params for tier in ("device", "host")}


# (label, formula, what each rank holds of: params, grads, optimizer states: "all", "shard" or "none"),
# and where it holds them. The formulas are checked against the estimator in draw_zero_stages.
ZERO_ROWS = [
    ("stage 0\nplain data parallel", "2 + 2 + 12", 2 + 2 + 12, 0, ("all", "all", "all")),
    ("stage 1\nP_os", "2 + 2 + 12/N", 2 + 2 + 12 / N, 1, ("all", "all", "shard")),
    ("stage 2\nP_os+g", "2 + (2 + 12)/N", 2 + (2 + 12) / N, 2, ("all", "shard", "shard")),
    ("stage 3\nP_os+g+p", "(2 + 2 + 12)/N", (2 + 2 + 12) / N, 3, ("shard", "shard", "shard")),
]
STATE_NAMES = ("fp16 params  2", "fp16 grads  2", "fp32 master, m, v  12")
OFFLOAD_NAMES = ("fp16 params  2", "fp32 grads  4 *", "fp32 master, m, v  12")


def _sharded_bar(
    ax, x: float, y: float, width: float, height: float, held: str, rank: int, color: str
) -> None:
    """A bar of N shards: all of them filled ("all"), only shard `rank` ("shard"), or none ("none")."""
    step = width / N
    for shard in range(N):
        filled = held == "all" or (held == "shard" and shard == rank)
        ax.add_patch(
            Rectangle(
                (x + shard * step, y),
                step,
                height,
                facecolor=color if filled else HOLLOW,
                edgecolor=EDGE,
                linewidth=0.7,
            )
        )


def _title(ax, width: float, height: float, text: str) -> None:
    ax.text(width / 2, height - 0.25, text, ha="center", va="center", fontsize=11, weight="bold")


def draw_zero_stages(path: Path) -> Path:
    width, height = 10.0, 6.5
    fig, ax = canvas(width, height)
    _title(
        ax,
        width,
        height,
        f"What each of N = {N} GPUs holds of the model states (mixed-precision Adam), in bytes per parameter",
    )
    cell_x0, cell_w, cell_gap = 3.0, 1.05, 0.2
    bar_w, bar_h, bar_gap = 0.84, 0.17, 0.09
    row_h, top = 1.0, height - 0.72
    for rank in range(N):
        ax.text(
            cell_x0 + rank * (cell_w + cell_gap) + bar_w / 2,
            top + 0.05,
            f"GPU {rank}",
            ha="center",
            fontsize=9,
        )
    ax.text(8.3, top + 0.05, "per GPU (× Ψ params)", ha="left", fontsize=9)

    rows = [(label, formula, value, stage, held, False) for label, formula, value, stage, held in ZERO_ROWS]
    rows.append(("stage 2 +\nCPU offload", None, None, 2, ("all", "shard", "shard"), True))
    for index, (label, formula, value, stage, held, offload) in enumerate(rows):
        y_top = top - 0.15 - index * row_h
        tiers = bytes_per_param(stage, offload)
        if not offload and abs(tiers["device"] - value) > 1e-9:
            raise AssertionError(f"stage {stage}: the formula gives {value}, the estimator {tiers['device']}")
        if index:
            ax.plot([0.15, width - 0.15], [y_top + 0.08] * 2, color="#dddddd", linewidth=0.8)
        ax.text(0.2, y_top - 0.4, label, ha="left", va="center", fontsize=10, weight="bold", linespacing=1.3)
        names = OFFLOAD_NAMES if offload else STATE_NAMES
        colors = (GPU, CPU, CPU) if offload else (GPU, GPU, GPU)
        for bar, (name, what, color) in enumerate(zip(names, held, colors, strict=True)):
            y = y_top - 0.15 - bar * (bar_h + bar_gap) - bar_h
            ax.text(cell_x0 - 0.12, y + bar_h / 2, name, ha="right", va="center", fontsize=8)
            for rank in range(N):
                x = cell_x0 + rank * (cell_w + cell_gap)
                _sharded_bar(ax, x, y, bar_w, bar_h, what, rank, color)
        if offload:
            host_formula = "(4 + 12)/N"
            if abs(tiers["device"] - 2) > 1e-9 or abs(tiers["host"] - 16 / N) > 1e-9:
                raise AssertionError(f"stage 2 + offload: the estimator gives {tiers}")
            ax.text(
                8.3, y_top - 0.22, f"GPU  2 = {tiers['device']:g} B/param", fontsize=9, color=GPU, va="center"
            )
            ax.text(
                8.3, y_top - 0.52, f"CPU  {host_formula}", fontsize=9, color=CPU, va="center", weight="bold"
            )
            ax.text(
                8.3, y_top - 0.76, f"       = {tiers['host']:g} B/param", fontsize=9, color=CPU, va="center"
            )
        else:
            ax.text(8.3, y_top - 0.32, formula, fontsize=9, va="center", weight="bold")
            ax.text(8.3, y_top - 0.6, f"= {tiers['device']:g} B/param", fontsize=9, va="center")

    legend = [
        Patch(facecolor=GPU, edgecolor=EDGE, label="held in this GPU's memory"),
        Patch(facecolor=CPU, edgecolor=EDGE, label="held in host memory, for this rank"),
        Patch(facecolor=HOLLOW, edgecolor=EDGE, label="held by another rank"),
    ]
    ax.legend(
        handles=legend, loc="lower left", bbox_to_anchor=(0.015, 0.0), ncol=3, fontsize=8, frameon=False
    )
    ax.text(
        0.2,
        0.42,
        "* with offload, fp16 gradients exist on the GPU only as buckets during backward; the host adds the "
        "rank's shard into fp32 (4 B). Staging buffers are not model states: not counted.",
        fontsize=7.5,
        color="#444444",
        va="center",
    )
    return save(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# 2. The offload data flow


def _node(ax, x: float, y: float, text: str, *, compute: bool, color: str, width: float = 1.7) -> None:
    """A compute node (filled, rounded) or a data node (white, square) centred at (x, y)."""
    h = 0.62
    style = "round,pad=0.02,rounding_size=0.18" if compute else "square,pad=0.02"
    ax.add_patch(
        FancyBboxPatch(
            (x - width / 2, y - h / 2),
            width,
            h,
            boxstyle=style,
            facecolor=color if compute else HOLLOW,
            edgecolor=color,
            linewidth=1.8,
            zorder=3,
        )
    )
    ax.text(
        x,
        y,
        text,
        ha="center",
        va="center",
        fontsize=9.5,
        color="white" if compute else INK,
        weight="bold" if compute else "normal",
        zorder=4,
        linespacing=1.25,
    )


def _arrow(ax, start, end, color: str, *, width: float = 1.6, rad: float = 0.0) -> None:
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle="-|>",
            mutation_scale=14,
            color=color,
            linewidth=width,
            connectionstyle=f"arc3,rad={rad}",
            zorder=2,
        )
    )


def _edge_label(ax, x: float, y: float, text: str, color: str = INK, **kwargs) -> None:
    ax.text(
        x,
        y,
        text,
        ha=kwargs.pop("ha", "center"),
        va="center",
        fontsize=8.5,
        color=color,
        bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0},
        zorder=5,
        **kwargs,
    )


def draw_offload_dataflow(path: Path) -> Path:
    width, height = 10.0, 5.0
    fig, ax = canvas(width, height)
    _title(
        ax, width, height, "One ZeRO-Offload step as a data-flow graph (after Ren et al., 2021, section 3)"
    )
    gpu_y0, gpu_y1, cpu_y0, cpu_y1, boundary = 2.85, 4.5, 0.75, 2.45, 2.65
    ax.add_patch(Rectangle((0.15, gpu_y0), width - 0.3, gpu_y1 - gpu_y0, facecolor=GPU, alpha=0.08, lw=0))
    ax.add_patch(Rectangle((0.15, cpu_y0), width - 0.3, cpu_y1 - cpu_y0, facecolor=CPU, alpha=0.08, lw=0))
    ax.text(0.3, gpu_y1 - 0.2, "GPU (HBM)", color=GPU, fontsize=10, weight="bold", va="center")
    ax.text(0.3, cpu_y0 + 0.2, "CPU (DDR)", color=CPU, fontsize=10, weight="bold", va="center")
    ax.plot([0.15, width - 0.15], [boundary] * 2, color=LINK, linestyle="--", linewidth=1.5)
    _edge_label(ax, 4.9, boundary, "PCIe: 2 B down + 2 B up per parameter", color=LINK, weight="bold")

    gpu_row, cpu_row = 3.75, 1.55
    params16, fwd_bwd = (1.9, gpu_row), (8.25, gpu_row)
    to_half, states32, adam, grads16 = (1.9, cpu_row), (4.2, cpu_row), (6.6, cpu_row), (8.6, cpu_row)
    _node(ax, *params16, "fp16 params\n2M B", compute=False, color=GPU)
    _node(ax, *fwd_bwd, "FWD-BWD", compute=True, color=GPU)
    _node(ax, *to_half, "float2half", compute=True, color=CPU, width=1.45)
    _node(ax, *states32, "fp32 params, m, v\n12M B", compute=False, color=CPU, width=1.75)
    _node(ax, *adam, "Adam update", compute=True, color=CPU, width=1.5)
    _node(ax, *grads16, "fp16 gradients\n2M B", compute=False, color=CPU, width=1.55)

    # GPU: the parameters feed forward and backward.
    _arrow(ax, (params16[0] + 0.88, gpu_row), (fwd_bwd[0] - 0.88, gpu_row), GPU)
    _edge_label(ax, (params16[0] + fwd_bwd[0]) / 2, gpu_row + 0.2, "read 2M in forward + 2M in backward")
    # Down the link: the gradients backward produces.
    _arrow(ax, (fwd_bwd[0] + 0.2, gpu_row - 0.34), (grads16[0] - 0.05, cpu_row + 0.34), LINK, width=2.4)
    _edge_label(ax, 9.2, boundary, "2M down (D2H)", color=LINK, weight="bold")
    # CPU: gradients into Adam, Adam reads and writes the fp32 states, float2half reads the new fp32 params.
    _arrow(ax, (grads16[0] - 0.79, cpu_row), (adam[0] + 0.77, cpu_row), CPU)
    _edge_label(ax, (grads16[0] + adam[0] + 0.77 - 0.79) / 2, cpu_row + 0.2, "2M")
    gap_left, gap_right = states32[0] + 0.9, adam[0] - 0.77
    _arrow(ax, (gap_left, cpu_row + 0.13), (gap_right, cpu_row + 0.13), CPU)
    _arrow(ax, (gap_right, cpu_row - 0.13), (gap_left, cpu_row - 0.13), CPU)
    _edge_label(ax, (gap_left + gap_right) / 2, cpu_row + 0.36, "read 12M")
    _edge_label(ax, (gap_left + gap_right) / 2, cpu_row - 0.36, "write 12M")
    _arrow(ax, (states32[0] - 0.9, cpu_row), (to_half[0] + 0.75, cpu_row), CPU)
    _edge_label(ax, (states32[0] - 0.9 + to_half[0] + 0.75) / 2, cpu_row + 0.2, "4M")
    # Up the link: the new fp16 parameters.
    _arrow(ax, (to_half[0], cpu_row + 0.34), (params16[0], gpu_row - 0.34), LINK, width=2.4)
    _edge_label(ax, 1.2, boundary, "2M up (H2D)", color=LINK, weight="bold")

    ax.text(fwd_bwd[0], gpu_row + 0.55, "compute O(M·B)", ha="center", fontsize=9, color=GPU, style="italic")
    ax.text(adam[0], cpu_row - 0.55, "compute O(M)", ha="center", fontsize=9, color=CPU, style="italic")
    ax.text(
        0.3,
        0.38,
        "M = number of parameters, B = batch size (tokens per step); edge labels are bytes per step. "
        "Rounded boxes compute, square boxes are data.\n"
        "Only the O(M) update moves to the CPU; the O(M·B) forward and backward stay on the GPU, "
        "and 4M bytes cross PCIe per step.",
        fontsize=8,
        color="#444444",
        va="center",
        linespacing=1.4,
    )
    return save(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# 3. The three schedules

# Illustrative durations (arbitrary time units), not measurements: forward of the whole model, and per unit
# backward, D2H of its gradient shard, host Adam, and H2D of its new weights.
FORWARD, BACKWARD, D2H, ADAM, H2D = 2.4, 1.2, 0.5, 1.2, 0.5
LANES = ("device compute", "D2H", "host Adam", "H2D")
ORDER = list(range(UNITS - 1, -1, -1))  # backward produces the last unit's gradient first
HORIZON = 2 * (FORWARD + UNITS * (BACKWARD + D2H + ADAM + H2D))  # two serial steps


class Gantt:
    """Blocks per lane: (lane, start, length, label, step)."""

    def __init__(self) -> None:
        self.blocks: list[tuple[str, float, float, str, int]] = []
        self.steps: list[float] = []  # when each step's forward starts

    def add(self, lane: str, start: float, length: float, label: str, step: int) -> float:
        self.blocks.append((lane, start, length, label, step))
        return start + length


def serial_schedule(steps: int) -> Gantt:
    """Chapter 3's step: each unit's D2H runs inline on the device thread, then Adam over the whole partition,
    then the uploads; the next forward starts after them."""
    g, t = Gantt(), 0.0
    for s in range(steps):
        g.steps.append(t)
        t = g.add("device compute", t, FORWARD, "forward", s)
        for k in ORDER:
            t = g.add("device compute", t, BACKWARD, f"B{k}", s)
            t = g.add("D2H", t, D2H, f"{k}", s)
        t = g.add("host Adam", t, UNITS * ADAM, "Adam (all units)", s)
        for k in range(UNITS):
            t = g.add("H2D", t, H2D, f"{k}", s)
    return g


def pipeline_schedule(steps: int) -> Gantt:
    """The overlapped pipeline with eager Adam: each unit's D2H, Adam and H2D start once its gradient exists and
    their queue is free; the next forward waits for the last upload."""
    g, t = Gantt(), 0.0
    for s in range(steps):
        g.steps.append(t)
        t = g.add("device compute", t, FORWARD, "forward", s)
        copy = host = up = 0.0
        for k in ORDER:
            t = g.add("device compute", t, BACKWARD, f"B{k}", s)
            copy = g.add("D2H", max(t, copy), D2H, f"{k}", s)
            host = g.add("host Adam", max(copy, host), ADAM, f"A{k}", s)
            up = g.add("H2D", max(host, up), H2D, f"{k}", s)
        t = max(t, up)
    return g


def dpu_schedule(steps: int) -> Gantt:
    """The delayed parameter update with the pipeline: step t launches Adam(g_t) over all units and does not wait;
    during step t+1's backward each unit's new weights go up once backward is done with it (and Adam(g_t) has
    finished); step t+1 ends by waiting for Adam(g_t) and those uploads, then launches Adam(g_t+1)."""
    g, t = Gantt(), 0.0
    copy = host = up = 0.0
    adam_end = None  # the end of the update in flight
    for s in range(steps):
        g.steps.append(t)
        t = g.add("device compute", t, FORWARD, "forward", s)
        last_upload = 0.0
        for k in ORDER:
            t = g.add("device compute", t, BACKWARD, f"B{k}", s)
            copy = g.add("D2H", max(t, copy), D2H, f"{k}", s)
            if adam_end is not None:
                up = last_upload = g.add("H2D", max(t, adam_end, up), H2D, f"{k}", s - 1)
        t = max(t, adam_end or 0.0, last_upload)  # finish(): the previous update has landed
        host = adam_end = g.add("host Adam", max(t, copy, host), UNITS * ADAM, f"Adam(g_{_step_name(s)})", s)
    return g


def _step_name(step: int) -> str:
    return "t" if step == 0 else f"t+{step}"


def _shade(lane: str, step: int) -> str:
    dark = {"device compute": GPU, "D2H": LINK, "host Adam": CPU, "H2D": LINK}[lane]
    light = {"device compute": GPU_LIGHT, "D2H": LINK_LIGHT, "host Adam": CPU_LIGHT, "H2D": LINK_LIGHT}[lane]
    return dark if step % 2 == 0 else light


def _draw_gantt(ax, gantt: Gantt, title: str) -> None:
    ys = {lane: len(LANES) - 1 - i for i, lane in enumerate(LANES)}
    min_label = 0.32 * HORIZON / 32  # narrower blocks stay unlabelled
    for lane, start, length, label, step in gantt.blocks:
        if start >= HORIZON:
            continue
        color = _shade(lane, step)
        ax.add_patch(
            Rectangle(
                (start, ys[lane] - 0.36), length, 0.72, facecolor=color, edgecolor="white", linewidth=0.8
            )
        )
        if length >= min_label and start + length <= HORIZON + 1e-9:
            ax.text(
                start + length / 2,
                ys[lane],
                label,
                ha="center",
                va="center",
                fontsize=6.5 if len(label) <= 2 else 7,
                color="white" if step % 2 == 0 else INK,
                clip_on=True,
            )
    for s, start in enumerate(gantt.steps):
        if start >= HORIZON - 1.5:  # no room left for the label
            break
        ax.axvline(start, color="#999999", linestyle=":", linewidth=0.9)
        ax.text(
            start + 0.12,
            len(LANES) - 0.45,
            f"step {_step_name(s)}",
            fontsize=7.5,
            va="bottom",
            color="#333333",
        )
    ax.set_xlim(0, HORIZON)
    ax.set_ylim(-0.6, len(LANES) - 0.45 + 0.42)
    ax.set_yticks([ys[lane] for lane in LANES], LANES, fontsize=8)
    ax.tick_params(axis="y", length=0)
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, fontsize=9, loc="left")


def draw_pipeline_schedule(path: Path) -> Path:
    fig, axes = plt.subplots(3, 1, figsize=(10, 6.4), sharex=True)
    panels = [
        (
            serial_schedule(3),
            "serial: D2H inline in backward, then Adam over the whole partition, then H2D; the GPU waits",
        ),
        (
            pipeline_schedule(4),
            "overlapped pipeline: each unit's D2H, Adam and H2D start as soon as its gradient exists "
            "(no overflow check, no clipping)",
        ),
        (
            dpu_schedule(5),
            "delayed parameter update: Adam(g_t) runs under step t+1's forward/backward; "
            "its uploads go up during that backward",
        ),
    ]
    for ax, (gantt, title) in zip(axes, panels, strict=True):
        _draw_gantt(ax, gantt, title)
    axes[-1].set_xlabel("time (illustrative units)", fontsize=8.5)
    legend = [
        Patch(facecolor=GPU, label="GPU forward / backward (Bk: unit k)"),
        Patch(facecolor=LINK, label="PCIe copy of unit k"),
        Patch(facecolor=CPU, label="CPU Adam (Ak: unit k)"),
        Patch(facecolor="#dddddd", label="lighter shade: the next step's work"),
    ]
    fig.legend(
        handles=legend, loc="lower center", ncol=4, fontsize=8, frameon=False, bbox_to_anchor=(0.5, 0.0)
    )
    fig.suptitle(
        f"Three schedules of an offloaded step on {UNITS} units (durations illustrative, not measured)",
        fontsize=11,
        weight="bold",
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return save(fig, path)


# ---------------------------------------------------------------------------------------------------------------

FIGURES = {
    "zero-stages.png": draw_zero_stages,
    "offload-dataflow.png": draw_offload_dataflow,
    "pipeline-schedule.png": draw_pipeline_schedule,
}
