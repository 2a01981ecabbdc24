"""Lesson 4's figures: each function draws one from the numbers a section measured and returns the figure.

The notebook saves and displays it (plots.show), so the file under out/lessons/04/ and the picture in the
notebook are the same one.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # the notebook displays the saved file, so no interactive backend is needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def roofline_sweep(gbs: dict, sizes: list[int], kinds) -> plt.Figure:
    """GB/s against the working set for each kind; the L2 and L3 sizes of the machine the lesson ran on."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ws = np.array(sizes) * 16 / 2**20
    for kind, style in zip(kinds, ("s-", "o-", "k--"), strict=True):
        ax.plot(ws, [gbs[kind, n] for n in sizes], style, label=kind, markersize=4)
    for size, label in ((1, "L2 (1 MiB a core)"), (32, "L3 (32 MiB)")):
        ax.axvline(size, color="gray", linewidth=1, linestyle=":")
        ax.text(size * 1.1, ax.get_ylim()[1] * 0.92, label, fontsize=8, color="gray")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("working set: w, g, m, v (MiB)")
    ax.set_ylabel("GB/s at 28 bytes a parameter")
    ax.set_title("One thread: the same kernel in cache and in DRAM")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return fig


def implementations(impl_ms: dict, floor_ms: float, n: int) -> plt.Figure:
    """One bar a step implementation in GB/s, ours in blue, and the memory floor as a line."""
    fig, ax = plt.subplots(figsize=(7.5, 4))
    names = list(impl_ms)
    gbs = [28 * n / impl_ms[name] / 1e6 for name in names]
    ax.barh(names, gbs, color=["tab:blue" if name.startswith("ours") else "tab:gray" for name in names])
    for y, value in enumerate(gbs):
        ax.text(value, y, f" {value:.1f}", va="center", fontsize=8)
    floor_gbs = 28 * n / floor_ms / 1e6
    ax.axvline(floor_gbs, color="black", linestyle="--", label=f"memory floor {floor_gbs:.1f} GB/s")
    ax.invert_yaxis()
    ax.set_xlim(0, 1.15 * max(max(gbs), floor_gbs))
    ax.set_xlabel("GB/s (28 bytes a parameter)")
    ax.set_title(f"Adam step, {n / 1e6:.1f}M fp32 params, 2 threads")
    ax.legend(fontsize=8, loc="upper right")
    return fig


def threads(rates: dict, kinds, max_threads: int, cores: int, n: int) -> plt.Figure:
    """Parameters a second against threads for each kind, with the core count marked."""
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = list(range(1, max_threads + 1))
    for kind, style in zip(kinds, ("o-", "s-", "^-", "k--"), strict=True):
        ax.plot(xs, [rates[kind, t] / 1e6 for t in xs], style, label=kind)
    ax.axvline(cores, color="gray", linestyle=":", linewidth=1)
    ax.text(
        cores, 0, f" {cores} cores", fontsize=8, color="gray", va="bottom", transform=ax.get_xaxis_transform()
    )
    ax.set_xticks(xs)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("threads")
    ax.set_ylabel("million parameters per second")
    ax.set_title(f"CPU Adam throughput vs threads ({n / 1e6:.1f}M params, cold caches)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def partial_offload(partial: dict, model: str) -> plt.Figure:
    """Left: model-state bytes on the device and the host per ratio; right: the CPU Adam time per step."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = ["no offload" if r is None else f"ratio {r:g}" for r in partial]
    pos = np.arange(len(labels))
    for offset, tier, color in ((-0.2, "device", "tab:red"), (0.2, "host", "tab:blue")):
        values = [partial[r][tier] / 2**20 for r in partial]
        ax1.bar(pos + offset, values, 0.4, color=color, label=f"{tier} (model states)")
        for p, v in zip(pos + offset, values, strict=True):
            ax1.text(p, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(pos, labels)
    ax1.set_ylabel("MiB")
    ax1.set_title(f"TinyGPT('{model}'): bytes per tier")
    ax1.legend(fontsize=8)
    offloaded = [r for r in partial if r is not None]
    adam_ms = [partial[r]["adam_s"] * 1e3 for r in offloaded]
    ax2.bar(np.arange(len(offloaded)), adam_ms, 0.5, color="tab:green")
    for p, v in enumerate(adam_ms):
        ax2.text(p, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(np.arange(len(offloaded)), [f"ratio {r:g}" for r in offloaded])
    ax2.set_ylabel("ms per step (median)")
    ax2.set_title("CPU Adam time per step (adam_seconds)")
    return fig


def step_parts(batches: list[int], times: list, seq_len: int) -> plt.Figure:
    """The serial step split into compute, PCIe and CPU Adam per 1,000 tokens, and the overlapped step on top."""
    tokens = np.array(batches) * seq_len
    fig, ax = plt.subplots(figsize=(7.5, 4))
    pos = np.arange(len(batches))
    bottom = np.zeros(len(batches))
    labels = {
        "pcie": "PCIe, down then up (2 + 2 bytes/param)",
        "cpu_adam": "CPU Adam",
        "compute": "GPU compute (8 P tokens)",
    }
    for part, color in (("compute", "tab:green"), ("pcie", "tab:orange"), ("cpu_adam", "tab:blue")):
        share = np.array([getattr(t, part) for t in times]) * 1e6 / tokens  # ms per 1,000 tokens
        ax.bar(pos, share, 0.6, bottom=bottom, color=color, label=labels[part])
        bottom += share
    ax.plot(
        pos,
        [t.overlapped * 1e6 / k for t, k in zip(times, tokens, strict=True)],
        "k_",
        markersize=22,
        markeredgewidth=2,
        label="overlapped: the busiest resource",
    )
    ax.set_xticks(pos, [str(b) for b in batches])
    ax.set_xlabel(f"micro-batch (sequences of {seq_len} tokens)")
    ax.set_ylabel("ms per 1,000 tokens")
    ax.set_title("13B, one A100-80GB, stage 2 + offload: serial step split per token")
    ax.legend(fontsize=8)
    return fig


def moment_decay(decay: dict[str, list[float]]) -> plt.Figure:
    """v of one element with no gradient, step by step, stored in each precision (lesson 4, section 8)."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for (precision, history), style in zip(decay.items(), ("k-", "b--", "r:"), strict=True):
        ax.plot(range(1, len(history) + 1), history, style, label=f"v stored in {precision}", linewidth=1.6)
    ax.set_yscale("log")
    ax.set_xlabel("step (gradient 0 for this element)")
    ax.set_ylabel("v")
    ax.set_title("v <- beta2 v, beta2 = 0.999: a narrow v rounds back to where it was")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return fig
