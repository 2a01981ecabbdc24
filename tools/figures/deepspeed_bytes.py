"""Bytes a parameter crosses PCIe per optimizer step: DeepSpeed (commit edaa722, v0.19.5-27) beside this engine.

- deepspeed-bytes.png: two panels, ZeRO-2 + CPU offload of the optimizer and ZeRO-3 + offload_param +
  offload_optimizer (both on the CPU). In each, four stacked bars: DeepSpeed's D2H and H2D, this engine's D2H
  and H2D, per parameter of the rank's shard, one micro-batch a step (gradient_accumulation_steps 1), fp16.

Every number is stated below, each copy with where it happens: a DeepSpeed file:line at edaa722 (read in
chapter 3a, course/03a-reading-deepspeed.md) or this engine's function. This engine's numbers are also what
lesson 3 measures (lessons/03_implementation.ipynb, section 3; tests/course/test_figures_deepspeed_bytes.py
compares them). Nothing is measured here, nothing random, no network.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from .style import CPU, EDGE, GPU, INK, LINK, LINK_LIGHT, save

FP16, FP32 = 2, 4  # bytes an element


@dataclass(frozen=True)
class Copy:
    """One copy across PCIe: its label in the figure, its bytes a parameter, and whether it always happens."""

    label: str
    nbytes: int
    always: bool = True


# --- ZeRO-2 + "offload_optimizer": {"device": "cpu"} ----------------------------------------------------------
DEEPSPEED_ZERO2 = {
    "D2H": (
        # stage_1_and_2.py#L1601-L1604: the gradient slice is cast to the master dtype (fp32) on the GPU,
        # then copied into the host's fp32 gradient partition.
        Copy("fp32 gradient", FP32),
    ),
    "H2D": (
        # stage_1_and_2.py#L2340-L2341: fp32 master rounded into the 16-bit host buffer, then uploaded.
        Copy("fp16 weights", FP16),
    ),
}
OURS_ZERO2 = {
    # implementation/offload.py gradients_to_host (Lab 3.1): the fp16 shard goes down, is unscaled and
    # accumulated into fp32 on the host.
    "D2H": (Copy("fp16 gradient", FP16),),
    # implementation/offload.py upload_weights (Lab 3.3): rounded on the host, the fp16 shard goes up.
    "H2D": (Copy("fp16 weights", FP16),),
}

# --- ZeRO-3 + "offload_param": {"device": "cpu"} + "offload_optimizer": {"device": "cpu"} ----------------------
DEEPSPEED_ZERO3 = {
    "D2H": (
        # stage3.py#L1905: partition_grads copies the reduced fp16 gradient partition into the flat gradient
        # buffer, which lives on the host under offload_optimizer (stage3.py#L328 self.device; #L742 its dtype,
        # gradient_accumulation_dtype, is the model's 16-bit type unless data_types.grad_accum_dtype says
        # otherwise: engine.py#L1492-L1493).
        Copy("fp16 gradient", FP16),
        # stage3.py#L1407: at the accumulation boundary, cast to fp32 on the GPU and copied into the host's fp32
        # gradient of the sub-group.
        Copy("fp32 gradient", FP32),
    ),
    "H2D": (
        # stage3.py#L1908: the host buffer goes straight back to the GPU (norm and fp32 cast are done there).
        Copy("fp16 gradient back", FP16),
        # partition_parameters.py#L1332: the all-gather first moves the host shard to the device; forward.
        Copy("gather, forward", FP16),
        # partitioned_param_coordinator.py#L653-L662: a parameter is released after its forward only if its
        # next use is more than stage3_max_reuse_distance (1e9 elements) away; then backward gathers it again.
        Copy("gather, backward", FP16, always=False),
    ),
}
# After DeepSpeed's step nothing goes up: stage3.py#L2589 rounds fp32 into the fp16 shard on the host.
OURS_ZERO3 = {
    # implementation/offload.py _deliver_gradient -> gradients_to_host, as at ZeRO-2.
    "D2H": (Copy("fp16 gradient", FP16),),
    "H2D": (
        # implementation/offload.py _shard_on_device: every gather uploads the host shard first. The unit is
        # released after its forward (principles/stage3_gather.py) and gathered again for backward.
        Copy("gather, forward", FP16),
        Copy("gather, backward", FP16),
    ),
}
# This engine's publish() uploads nothing with offload_param (implementation/offload.py): rounded on the host.

PANELS = {
    "ZeRO-2 + offload_optimizer": (DEEPSPEED_ZERO2, OURS_ZERO2),
    "ZeRO-3 + offload_param + offload_optimizer": (DEEPSPEED_ZERO3, OURS_ZERO3),
}


def total(copies: tuple[Copy, ...], *, only_always: bool = False) -> int:
    """Bytes a parameter of these copies; `only_always`: leave out the ones that depend on the model's size."""
    return sum(c.nbytes for c in copies if c.always or not only_always)


def totals() -> dict[str, dict[str, dict[str, int]]]:
    """{panel: {"DeepSpeed" | "this engine": {"D2H": bytes, "H2D": bytes}}}, every copy counted."""
    return {
        panel: {
            who: {direction: total(copies) for direction, copies in side.items()}
            for who, side in (("DeepSpeed", ds), ("this engine", ours))
        }
        for panel, (ds, ours) in PANELS.items()
    }


def _panel(ax, title: str, deepspeed: dict, ours: dict) -> None:
    bars = [("DeepSpeed", "D2H", deepspeed), ("DeepSpeed", "H2D", deepspeed)]
    bars += [("this engine", "D2H", ours), ("this engine", "H2D", ours)]
    positions = [0, 1.15, 2.75, 3.9]
    for x, (_, direction, side) in zip(positions, bars, strict=True):
        bottom = 0
        for copy in side[direction]:
            ax.bar(
                x, copy.nbytes, 0.95, bottom=bottom, color=LINK if copy.always else LINK_LIGHT,
                edgecolor="white" if copy.always else EDGE, hatch="" if copy.always else "//", linewidth=1.2,
            )  # fmt: skip
            ax.text(x, bottom + copy.nbytes / 2, f"{copy.label}\n{copy.nbytes} B", ha="center", va="center",
                    fontsize=7, color=INK)  # fmt: skip
            bottom += copy.nbytes
        ax.text(x, bottom + 0.15, f"{bottom}", ha="center", va="bottom", fontsize=10, weight="bold")
    ax.set_xticks(positions, ["DeepSpeed\nD2H", "DeepSpeed\nH2D", "this engine\nD2H", "this engine\nH2D"])
    for tick, (who, _, _) in zip(ax.get_xticklabels(), bars, strict=True):
        tick.set_color(CPU if who == "DeepSpeed" else GPU)
    ax.axhline(FP16, color=INK, linestyle="--", linewidth=0.8, zorder=0.5)  # behind the bars
    ax.text(4.42, FP16, "paper:\n2 each way", fontsize=7, va="center", ha="left")
    ax.set_ylim(0, 7.2)
    ax.set_xlim(-0.6, 5.0)
    ax.set_title(title, fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)


def draw_deepspeed_bytes(path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 5.2), sharey=True)
    for ax, (title, (deepspeed, ours)) in zip(axes, PANELS.items(), strict=True):
        _panel(ax, title, deepspeed, ours)
    axes[0].set_ylabel("bytes per parameter per step (rank's shard)")
    fig.legend(
        handles=[
            Patch(facecolor=LINK, label="always"),
            Patch(facecolor=LINK_LIGHT, edgecolor=EDGE, hatch="//",
                  label="only if the parameter is released between forward and backward (large models)"),
        ],  # fmt: skip
        loc="lower center", ncol=2, fontsize=8, frameon=False,
    )  # fmt: skip
    fig.suptitle("PCIe bytes per parameter per step: DeepSpeed edaa722 vs this engine (fp16, 1 micro-batch)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return save(fig, path)


FIGURES = {"deepspeed-bytes.png": draw_deepspeed_bytes}
