"""Offload systems since 2021 on one chart: the largest model each paper says it trains, by the paper's date.

Only numbers that a paper states, each with its citation (the `CLAIMS` table; chapter 6 quotes the same table).
The x position is the month of the paper's first arXiv version, read from its identifier (2101 is January
2021), so two papers of the same year do not overlap. The y axis is the model size in billions of parameters,
log scale. The colour is the hardware the claim needs: one GPU (with its host), one node, or a cluster; the
label under each point names the hardware, because a claim is only as large as the machine under it.

Systems of chapter 6 that state no such number are listed in `NOT_PLOTTED` with the reason; the chart does not
invent one for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt

from .style import CPU, GPU, INK, NVME, save


@dataclass(frozen=True)
class Claim:
    system: str
    arxiv: str  # the paper's arXiv identifier: its first version's month is the x position
    billions: float  # model size the paper says it trains, billions of parameters
    setting: str  # "one GPU", "one node" or "cluster"
    hardware: str  # the hardware under the claim, as the paper states it
    citation: str  # where the paper says it


CLAIMS = (
    Claim(
        "ZeRO-Offload",
        "2101.06840",
        13,
        "one GPU",
        "1x V100 32 GB",
        "Ren et al., ZeRO-Offload: Democratizing Billion-Scale Model Training, USENIX ATC 2021, "
        "arXiv:2101.06840, abstract: over 13 billion parameters on a single GPU",
    ),
    Claim(
        "ZeRO-Offload + MP",
        "2101.06840",
        70,
        "one node",
        "DGX-2, 16x V100",
        "Ren et al., ZeRO-Offload, USENIX ATC 2021, arXiv:2101.06840, abstract: with model parallelism, "
        "over 70 billion parameters on a single DGX-2 box",
    ),
    Claim(
        "ZeRO-Infinity",
        "2104.07857",
        1000,
        "one node",
        "DGX-2, 16x V100",
        "Rajbhandari et al., ZeRO-Infinity: Breaking the GPU Memory Wall for Extreme Scale Deep Learning, "
        "SC 2021, arXiv:2104.07857, abstract: fine-tune trillion-parameter models on a single DGX-2 node",
    ),
    Claim(
        "ZeRO-Infinity",
        "2104.07857",
        32000,
        "cluster",
        "512x V100 (32 DGX-2)",
        "Rajbhandari et al., ZeRO-Infinity, SC 2021, arXiv:2104.07857, section 1 (contributions) and section 8 "
        "(evaluation): a 32 trillion parameter model on 512 NVIDIA V100 GPUs (32 DGX-2 nodes)",
    ),
    Claim(
        "PatrickStar",
        "2108.05818",
        12,
        "one node",
        "8x V100, 240 GB host",
        "Fang et al., PatrickStar: Parallel Training of Pre-trained Models via Chunk-based Memory Management, "
        "arXiv:2108.05818 v1, abstract: a 12 billion parameter GPT on an 8xV100 node with 240 GB of memory",
    ),
    Claim(
        "PatrickStar",
        "2108.05818",
        175,
        "cluster",
        "32 GPUs",
        "Fang et al., Parallel Training of Pre-Trained Models via Chunk-Based Dynamic Memory Management, "
        "IEEE TPDS 2022 (arXiv:2108.05818, later version), abstract: a 175B GPT-3 on 32 GPUs",
    ),
    Claim(
        "LoHan (Fuyou)",
        "2403.06504",
        175,
        "one GPU",
        "1x RTX 4090, 256 GB host, SSDs",
        "Liao et al., LoHan: Low-Cost High-Performance Framework to Fine-Tune 100B Model on a Consumer GPU, "
        "arXiv:2403.06504 v2, abstract: fine-tuning a 175B model on an RTX 4090 with 256 GB of main memory",
    ),
    Claim(
        "SuperOffload",
        "2509.21271",
        25,
        "one GPU",
        "1x GH200 Superchip",
        "Lian, Tanaka, Ruwase, Zhang, SuperOffload: Unleashing the Power of Large-Scale LLM Training on "
        "Superchips, ASPLOS 2026, arXiv:2509.21271, abstract: models up to 25B on a single Superchip",
    ),
)

NOT_PLOTTED = {
    "ZeRO++": "a communication method for ZeRO-3 (arXiv:2306.10209); it states throughput (up to 2.16x at "
    "384 GPUs) and communication volume (4x less), not a largest model",
    "MiCS": "a sharding method for the cloud (arXiv:2205.00119); its 100B model on 512 GPUs is a scaling "
    "result (99.4% weak-scaling efficiency), with no offload and no claim of a largest model",
    "FSDP CPU offload": "PyTorch documents CPUOffload / CPUOffloadPolicy without a headline model size",
    "ZenFlow": "states speed (up to 5x over ZeRO-Offload, arXiv:2505.12242), not a largest model",
    "Twin-Flow (ZeRO-Offload++)": "a blog post stating throughput (up to 6x), no paper and no model size",
    "DeepCompile": "states speed (up to 1.28x over ZeRO-3, 7.01x when offloading, arXiv:2504.09983)",
}

COLOURS = {"one GPU": GPU, "one node": CPU, "cluster": NVME}
MARKERS = {"one GPU": "o", "one node": "s", "cluster": "^"}


def year_of(arxiv: str) -> float:
    """2101.06840 -> 2021.0 (January), 2509.21271 -> 2025.67 (September): the first version's month."""
    yymm = arxiv.split(".")[0]
    return 2000 + int(yymm[:2]) + (int(yymm[2:]) - 1) / 12


def draw_systems(path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(10, 5.6))
    seen = set()
    # Label offsets in points, chosen so that the labels of 2021's crowd do not overlap.
    offsets = {
        ("ZeRO-Offload", "one GPU"): (-8, -4),
        ("ZeRO-Offload + MP", "one node"): (-8, -4),
        ("ZeRO-Infinity", "one node"): (8, -4),
        ("ZeRO-Infinity", "cluster"): (8, -4),
        ("PatrickStar", "one node"): (8, -4),
        ("PatrickStar", "cluster"): (8, -4),
        ("LoHan (Fuyou)", "one GPU"): (-10, 10),
        ("SuperOffload", "one GPU"): (-10, 10),
    }
    for claim in CLAIMS:
        x = year_of(claim.arxiv)
        ax.scatter(
            x,
            claim.billions,
            s=70,
            color=COLOURS[claim.setting],
            marker=MARKERS[claim.setting],
            edgecolor=INK,
            zorder=3,
            label=None if claim.setting in seen else claim.setting,
        )
        seen.add(claim.setting)
        dx, dy = offsets[(claim.system, claim.setting)]
        ax.annotate(
            f"{claim.system}: {claim.billions:g}B\n{claim.hardware}",
            (x, claim.billions),
            xytext=(dx, dy),
            textcoords="offset points",
            ha="right" if dx < 0 else "left",
            va="bottom" if dy > 0 else "top",
            fontsize=8,
            color=INK,
        )
    ax.set_yscale("log")
    ax.set_ylim(5, 1e5)
    ax.set_xlim(2019.8, 2026.4)
    ax.set_xticks(range(2021, 2027))
    ax.set_xlabel("first arXiv version of the paper")
    ax.set_ylabel("largest model the paper says it trains\n(billions of parameters, log scale)")
    ax.set_title("Offload systems since 2021: the model sizes their papers claim, by hardware")
    ax.grid(alpha=0.3, which="both")
    ax.legend(title="hardware of the claim", loc="upper right", fontsize=8, title_fontsize=8)
    fig.text(
        0.01,
        0.01,
        "Not plotted (their papers claim no model size): " + ", ".join(NOT_PLOTTED),
        fontsize=7.5,
        color="#555555",
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return save(fig, path)


FIGURES = {"offload-systems.png": draw_systems}
