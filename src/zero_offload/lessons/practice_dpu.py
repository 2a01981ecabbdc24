"""Lesson 5, section 4: what a one-step-stale gradient (delayed parameter update, DPU) costs in loss.

The engine's DPU runs are set against a plain-torch reference that takes each gradient on the weights before the
last update: if the two agree to rounding, the lag in loss is the cost of staleness, not an engine bug.
"""

from __future__ import annotations

import statistics
import time

import matplotlib

matplotlib.use("Agg")  # the notebook displays the saved file
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from .. import plots  # noqa: E402
from ..workloads import ByteBatches, TinyGPT, gpt_config, lm_loss  # noqa: E402
from .practice_steps import offload_config, train_engine  # noqa: E402


@torch.no_grad()
def evaluate(engine, held_out: ByteBatches, batch: int, batches: int = 8) -> float:
    """Mean loss over the first `batches` held-out batches."""
    return statistics.mean(
        lm_loss(engine(x), y).item() for x, y in (held_out.global_batch(i, batch) for i in range(batches))
    )


def dpu_runs(model: str, steps: int, batch: int, starts, corpus) -> dict:
    """One overlapped run per DPU start step (None: no DPU), one C Adam thread: losses, held-out loss, seconds."""
    held_out = ByteBatches(corpus, gpt_config(model).seq_len, seed=0, split="val")
    runs = {}
    for start in starts:
        label = "no DPU" if start is None else f"DPU from step {start}"
        config = offload_config(batch=batch, overlap=True, dpu_start=start)
        config["zero_offload"]["cpu_adam"]["threads"] = 1
        started = time.perf_counter()
        engine, losses = train_engine(config, model, steps, corpus, batch=batch)
        seconds = time.perf_counter() - started
        engine.synchronize()  # the last update is still in flight: land it before reading the weights
        runs[label] = {
            "start": start,
            "losses": losses,
            "eval": evaluate(engine, held_out, batch),
            "seconds": seconds,
        }
    return runs


def format_dpu(runs: dict) -> str:
    """Where each run first differs from no DPU, its late and held-out losses, and the steps before start_step."""
    plain = runs["no DPU"]["losses"]
    lines = [
        f"{'run':<20}{'first differing step':>22}{'mean loss, last 50':>20}{'held-out loss':>15}{'wall s':>8}"
    ]
    for label, r in runs.items():
        differ = next((i for i, (a, b) in enumerate(zip(r["losses"], plain, strict=True)) if a != b), None)
        lines.append(
            f"{label:<20}{'-' if differ is None else differ:>22}{statistics.mean(r['losses'][-50:]):>20.4f}"
            f"{r['eval']:>15.4f}{r['seconds']:>8.1f}"
        )
    for label, r in runs.items():
        if r["start"] is not None:
            s = r["start"]
            same = r["losses"][: s + 1] == plain[: s + 1]
            lines.append(
                f"{label}: losses of steps 0..{s} identical to no DPU: {same}; step {s + 1}: "
                f"{r['losses'][s + 1]:.6f} against {plain[s + 1]:.6f}"
            )
    return "\n".join(lines)


def smooth(values, window: int = 10) -> np.ndarray:
    return np.convolve(values, np.ones(window) / window, mode="valid")


def plot_dpu(runs: dict, model: str, window: int) -> plt.Figure:
    """Left: each run's loss (smoothed; raw faint); right: each DPU run's loss minus the loss without DPU."""
    plain = runs["no DPU"]["losses"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for (label, r), color in zip(runs.items(), ("black", "tab:red", "tab:blue"), strict=False):
        steps = np.arange(len(r["losses"]))
        ax1.plot(steps, r["losses"], color=color, alpha=0.2, linewidth=0.8)
        ax1.plot(steps[window - 1 :], smooth(r["losses"], window), color=color, label=label)
        if r["start"] is not None:
            ax1.axvline(r["start"], color=color, linestyle=":", linewidth=1)
            ax2.plot(
                steps[window - 1 :],
                smooth(np.array(r["losses"]) - np.array(plain), window),
                color=color,
                label=label,
            )
    ax1.set_xlabel("step")
    ax1.set_ylabel(plots.LOSS_LABEL)
    ax1.set_title(f"TinyGPT('{model}'): training loss ({window}-step mean; raw faint)")
    ax1.legend(fontsize=8)
    ax2.axhline(0, color="black", linewidth=1)
    ax2.set_xlabel("step")
    ax2.set_ylabel("loss with DPU - loss without")
    ax2.set_title(f"The cost of a one-step-stale gradient ({window}-step mean)")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    return fig


def stale_reference(model: str, start: int, steps: int, batch: int, corpus) -> list[float]:
    """Plain torch: the gradient of step t is taken on the weights before the last update once t > start.

    Each step swaps in the weights the forward should see, takes the gradient, swaps the current weights back
    and lets torch.optim.AdamW apply that gradient (the same construction as
    tests/modules/test_pipeline.py)."""
    net = TinyGPT(model, seed=0)
    params = list(net.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    data = ByteBatches(corpus, gpt_config(model).seq_len, seed=0)
    visible, losses = [p.detach().clone() for p in params], []
    for step in range(steps):
        current = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, v in zip(params, visible, strict=True):
                p.copy_(v)
        x, y = data.global_batch(step, batch)
        loss = lm_loss(net(x), y)
        net.zero_grad()
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p, c in zip(params, current, strict=True):
                p.copy_(c)
        optimizer.step()
        visible = [p.detach().clone() for p in params] if step + 1 <= start else current
    return losses
