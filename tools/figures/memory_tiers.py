"""Where the model states of a 13B model live, and how many bytes each takes, with and without offload.

- memory-tiers.png: for five configurations (no offload; ZeRO-Offload, i.e. stage 2 + offload_optimizer, on one
  GPU and on 8; stage 3 + offload_param to the host; the same to NVMe), the bytes of each model state (fp16
  parameters, gradients, fp32 master weights, Adam's m and v) in each tier (GPU HBM, CPU DRAM, NVMe), against
  the capacity of an 80 GB GPU and of a host with 512 GB of DRAM.

Every byte comes from `zero_offload.basics.estimate_model_states`, the estimator the engine reports against and
`zo estimate` prints, so the figure and `zo estimate 13B ...` cannot disagree. With 8 GPUs the bars show one GPU
and the whole host (8 ranks, each keeping its shard on the host). The capacities are assumptions, stated here:
80 GB is the HBM of an A100 80GB or an H100; 512 GB is a typical two-socket training host (servers range from
256 GB to 2 TB). Nothing is measured, nothing random, no network.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt

from zero_offload.basics.memory import STATES, TIERS, estimate_model_states

from .style import CPU, GPU, INK, NVME, save

PARAMS = 13_000_000_000  # the course introduction's 13B model
GPUS = 8  # the multi-GPU ZeRO-Offload row: one 8-GPU server
GPU_CAPACITY = 80e9  # bytes of HBM on an A100 80GB / H100 (an assumption of the figure)
HOST_CAPACITY = 512e9  # bytes of DRAM on a typical training host (an assumption of the figure)
GB = 1e9

# (label, estimator arguments, ranks whose host shards share one host)
CONFIGS = [
    ("no offload\nstage 0, 1 GPU", {"stage": 0, "world_size": 1}, 1),
    (
        "ZeRO-Offload\nstage 2 + offload_optimizer\n1 GPU",
        {"stage": 2, "world_size": 1, "offload_optimizer": "cpu"},
        1,
    ),
    (
        f"ZeRO-Offload, {GPUS} GPUs\nstage 2 + offload_optimizer\n(one GPU; the whole host)",
        {"stage": 2, "world_size": GPUS, "offload_optimizer": "cpu"},
        GPUS,
    ),
    (
        "stage 3 + offload_param\n+ offload_optimizer (cpu)\n1 GPU",
        {"stage": 3, "world_size": 1, "offload_optimizer": "cpu", "offload_param": "cpu"},
        1,
    ),
    (
        "stage 3, both offloads\nto NVMe, 1 GPU",
        {"stage": 3, "world_size": 1, "offload_optimizer": "nvme", "offload_param": "nvme"},
        1,
    ),
]
SHORT = {"parameters": "p", "gradients": "g", "master_weights": "w", "exp_avg": "m", "exp_avg_sq": "v"}
TIER_COLORS = {"device": GPU, "host": CPU, "nvme": NVME}
TIER_TITLES = {
    "device": "GPU HBM (per GPU)",
    "host": "CPU DRAM (the whole host)",
    "nvme": "NVMe",
}
# Each tier's axis spans this many GB, so that one GB is as wide in every panel.
TIER_SPANS = {"device": 270, "host": 560, "nvme": 250}


@dataclass(frozen=True)
class Row:
    label: str
    # bytes[tier] = [(state, bytes), ...] in STATES order, states with no bytes in that tier left out
    bytes: dict[str, list[tuple[str, int]]]

    def tier(self, tier: str) -> int:
        return sum(nbytes for _, nbytes in self.bytes[tier])


def rows(num_params: int = PARAMS) -> list[Row]:
    """The bars: for each configuration, the estimator's bytes of each state in each tier (one GPU's device;
    the host's bytes times the ranks that share it)."""
    found = []
    for label, kwargs, ranks in CONFIGS:
        states = estimate_model_states(num_params, precision="fp16", **kwargs)
        per_tier = {}
        for tier in TIERS:
            scale = ranks if tier != "device" else 1
            per_tier[tier] = [
                (state, scale * states.bytes[state][tier]) for state in STATES if states.bytes[state][tier]
            ]
        found.append(Row(label, per_tier))
    return found


def draw_memory_tiers(path: Path) -> Path:
    data = rows()
    spans = [TIER_SPANS[t] for t in TIERS]
    fig, axes = plt.subplots(
        1,
        len(TIERS),
        figsize=(11.0, 6.0),
        sharey=True,
        gridspec_kw={"width_ratios": spans, "wspace": 0.06},
    )
    fig.subplots_adjust(left=0.19, right=0.985, top=0.86, bottom=0.19)
    fig.suptitle(
        "Model states of a 13B model (mixed-precision Adam): bytes in each tier, from estimate_model_states",
        fontsize=11,
        weight="bold",
    )
    ys = list(range(len(data)))[::-1]
    for ax, tier in zip(axes, TIERS, strict=True):
        ax.set_xlim(0, TIER_SPANS[tier])
        ax.set_title(TIER_TITLES[tier], fontsize=10, color=TIER_COLORS[tier], weight="bold")
        ax.set_xlabel("GB", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(axis="x", color="#e6e6e6", linewidth=0.7)
        ax.set_axisbelow(True)
        for y, row in zip(ys, data, strict=True):
            left = 0.0
            for state, nbytes in row.bytes[tier]:
                width = nbytes / GB
                ax.barh(
                    y, width, left=left, height=0.6, color=TIER_COLORS[tier], edgecolor="white", linewidth=1.2
                )
                text = f"{SHORT[state]} {width:g}" if width >= 40 else SHORT[state]
                ax.text(left + width / 2, y, text, ha="center", va="center", fontsize=7.5, color="white")
                left += width
            total = row.tier(tier) / GB
            if total:
                ax.text(left + 4, y, f"{total:g} GB", va="center", fontsize=8.5, color=INK, weight="bold")
            else:
                ax.text(4, y, "0", va="center", fontsize=8.5, color="#888888")
        for capacity, name in ((GPU_CAPACITY, "80 GB GPU"), (HOST_CAPACITY, "512 GB host")):
            if (tier == "device") == (name == "80 GB GPU") and tier != "nvme":
                ax.axvline(capacity / GB, color="#c0392b", linestyle="--", linewidth=1.3)
                ax.text(
                    capacity / GB + (3 if tier == "device" else -3),
                    len(data) - 0.2,
                    f"capacity:\n{name}",
                    fontsize=8,
                    color="#c0392b",
                    va="center",
                    ha="left" if tier == "device" else "right",
                )
    axes[0].set_yticks(ys)
    axes[0].set_yticklabels([row.label for row in data], fontsize=8.5)
    axes[0].tick_params(axis="y", length=0)
    axes[0].set_ylim(-0.6, len(data) + 0.15)
    fig.text(
        0.01,
        0.02,
        "p = fp16 params (2 B/param)   g = gradients (fp16, 2 B, on the GPU; fp32, 4 B, when offloaded)   "
        "w = fp32 master weights (4 B)   m, v = Adam moments (4 B each).\n"
        f"16 B/param x 13e9 = 208 GB without offload; offloaded, the host keeps the gradients in fp32: 2 + 16 = 18 B. "
        f"{GPUS} GPUs: each rank's host shard x {GPUS}. Capacities are assumptions.",
        fontsize=7.5,
        color="#444444",
        va="bottom",
    )
    return save(fig, path)


FIGURES = {"memory-tiers.png": draw_memory_tiers}
