"""Lesson 5, sections 1 to 3: module 5's configuration, one step of each schedule zoomed in, and bit-identity runs.

`compare_schedules` (cli/bench/schedules.py) times whole steps; `zoom` here also reads each step's phases from the
engine's timeline, so that the lesson can say where the time of a step went and what overlapping hid.
"""

from __future__ import annotations

import os
import statistics
import time

import matplotlib

matplotlib.use("Agg")  # the notebook displays the saved file
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from .. import initialize  # noqa: E402
from ..accelerator import EmulatedAccelerator  # noqa: E402
from ..cli.bench.schedules import restored_threads, split_cores  # noqa: E402
from ..practice.timeline import STAGES  # noqa: E402
from ..workloads import ByteBatches, TinyGPT, gpt_config, lm_loss  # noqa: E402

# Each schedule as offload_config's switches: the same three engines compare_schedules builds.
SCHEDULE_SWITCHES = {
    "serial": {},
    "overlapped": {"overlap": True},
    "delayed (DPU)": {"overlap": True, "dpu_start": 2},
}


def offload_config(
    *,
    batch: int = 1,
    overlap: bool = False,
    dpu_start: int | None = None,
    cores=None,
    precision: str = "fp32",
    clip: float = 0.0,
    bucket: int = 1_000_000,
    slots: int = 4,
) -> dict:
    """Stage 2 + CPU offload, the C Adam; module 5's switches under "zero_offload" (compare_schedules' config)."""
    extension = {"cpu_adam": {"impl": "simd"}, "overlap_offload": overlap}
    if overlap:
        extension["staging_slots"] = slots
    if dpu_start is not None:
        extension["delayed_param_update"] = {"enabled": True, "start_step": dpu_start}
    if cores is not None:
        extension["cores"] = {"device": cores[0], "host": cores[1]}
    config = {
        "train_batch_size": batch,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        # Buckets of about one block, reduced as soon as they fill: gradients leave while backward runs.
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu"},
            "overlap_comm": True,
            "reduce_bucket_size": bucket,
        },
        "zero_offload": extension,
    }
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 12}
    return config


def step_spans(engine, step: int) -> list:
    """The spans of one step in the engine's timeline (rank 0)."""
    return [s for s in engine.timeline()[0] if s.step == step]


def phases(spans) -> dict:
    """ms of forward, backward, the host's Adam (busy), and the tail: from the end of backward to the step's last span."""
    ms = {
        stage: sum((s.end - s.start) * 1e3 for s in spans if s.stage == stage)
        for stage in ("forward", "backward", "Adam")
    }
    backward_end = max(s.end for s in spans if s.stage == "backward")
    ms["tail after backward"] = max(0.0, (max(s.end for s in spans) - backward_end) * 1e3)
    return ms


def zoom(model: str, seq_len: int, corpus, *, cores: str, rounds: int, block: int) -> dict:
    """Three engines taking turns, `block` steps each a round: each step's wall time and phases, and the spans
    of each engine's median step. A turn ends with engine.synchronize(), so that no update still in flight
    runs during the next engine's turn; the first round (warm-up) and the first step of every turn (it has no
    update of the step before to wait for) are not counted."""
    with restored_threads():  # the engines pin this thread and set torch's threads: give both back afterwards
        if cores == "shared":
            torch.set_num_threads(
                len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            )
        pinned = split_cores() if cores == "split" else None
        data = ByteBatches(corpus, seq_len, seed=0)
        engines = {
            name: initialize(
                TinyGPT(gpt_config(model, seq_len=seq_len), seed=0),
                offload_config(cores=pinned, **switches),
                accelerator=EmulatedAccelerator(),
            )
            for name, switches in SCHEDULE_SWITCHES.items()
        }
        walls = {name: {} for name in engines}
        for turn in range(rounds):
            for name, engine in engines.items():
                for k in range(block):
                    step = engine.global_steps
                    x, y = data.global_batch(step, 1)
                    started = time.perf_counter()
                    engine.backward(lm_loss(engine(x), y))
                    engine.step()
                    if turn > 0 and k > 0:
                        walls[name][step] = (time.perf_counter() - started) * 1e3
                engine.synchronize()
        result = {}
        for name, engine in engines.items():
            measured = sorted(walls[name])
            per_step = {step: phases(step_spans(engine, step)) for step in measured}
            median_step = sorted(measured, key=lambda k: walls[name][k])[len(measured) // 2]
            result[name] = {
                "wall": statistics.median(walls[name][k] for k in measured),
                **{p: statistics.median(per_step[k][p] for k in measured) for p in per_step[measured[0]]},
                "spans": step_spans(engine, median_step),
                "steps": len(measured),
            }
        return result


def format_phases(zoomed: dict) -> str:
    lines = [
        f"{'schedule':<16}{'step (wall)':>12}{'forward':>9}{'backward':>10}{'CPU Adam':>10}"
        f"{'tail after backward':>21}"
    ]
    for name, r in zoomed.items():
        lines.append(
            f"{name:<16}{r['wall']:>12.1f}{r['forward']:>9.1f}{r['backward']:>10.1f}{r['Adam']:>10.1f}"
            f"{r['tail after backward']:>21.1f}"
        )
    return "\n".join(lines)


def format_schedules(results: dict, label: str, *, dpu_ratio: bool = True) -> str:
    """One row a compare_schedules result: ms of each schedule, overlapped/serial and (optionally) DPU/serial."""
    width = max(8, len(label) + 2, *(len(str(k)) + 2 for k in results))
    head = f"{label:<{width}}{'serial':>9}{'overlapped':>12}{'DPU':>8}{'overlapped vs serial':>22}"
    lines = [head + (f"{'DPU vs serial':>15}" if dpu_ratio else "")]
    for key, r in results.items():
        ms = r["median_ms"]
        row = (
            f"{key!s:<{width}}{ms['serial']:>9.1f}{ms['overlapped']:>12.1f}{ms['delayed (DPU)']:>8.1f}"
            f"{r['overlapped_vs_serial']:>21.2f}x"
        )
        lines.append(row + (f"{ms['serial'] / ms['delayed (DPU)']:>14.2f}x" if dpu_ratio else ""))
    return "\n".join(lines)


def draw_steps(zoomed: dict, title: str) -> plt.Figure:
    """One step of each schedule (the one with the median wall time), lanes per stage, time from its first span."""
    colors = dict(zip(STAGES, plt.get_cmap("tab10").colors, strict=False))
    lanes = [s for s in STAGES if any(span.stage == s for r in zoomed.values() for span in r["spans"])]
    fig, axes = plt.subplots(len(zoomed), 1, figsize=(10, 1.1 + 0.42 * len(lanes) * len(zoomed)), sharex=True)
    for ax, (schedule, r) in zip(axes, zoomed.items(), strict=True):
        origin = min(s.start for s in r["spans"])
        for lane, stage in enumerate(lanes):
            bars = [
                ((s.start - origin) * 1e3, max((s.end - s.start) * 1e3, 0.05))  # a bar at least 50 us wide
                for s in r["spans"]
                if s.stage == stage
            ]
            ax.broken_barh(bars, (lane - 0.4, 0.8), color=colors[stage])
        ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{schedule}: {r['wall']:.0f} ms a step (median)", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("time within the step (ms)")
    fig.suptitle(title, fontsize=10)
    return fig


def train_engine(config: dict | None, model: str, steps: int, corpus, *, batch: int, engine=None):
    """Train `steps` steps of TinyGPT(model) with `config` (or go on with `engine`); the engine and the losses.

    The batches depend only on the step number, so two engines given the same steps see the same data."""
    engine = engine or initialize(TinyGPT(model, seed=0), config, accelerator=EmulatedAccelerator())
    data = ByteBatches(corpus, gpt_config(model).seq_len, seed=0)
    losses = []
    for _ in range(steps):
        x, y = data.global_batch(engine.global_steps, batch)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


def weights(engine) -> dict:
    return {name: p.detach().clone() for name, p in engine.model.named_parameters()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def bit_identity(model: str, steps: int, corpus, *, bucket: int, batch: int = 4, **kwargs) -> str:
    """Serial against overlapped with the same config: losses, weights, link bytes, and where the first Adam ran."""
    runs = {
        overlap: train_engine(
            offload_config(batch=batch, overlap=overlap, bucket=bucket, **kwargs),
            model,
            steps,
            corpus,
            batch=batch,
        )
        for overlap in (False, True)
    }
    (serial_engine, serial_losses), (overlap_engine, overlap_losses) = runs[False], runs[True]
    pcie = [dict(e.states.transfers.bytes) for e in (serial_engine, overlap_engine)]
    spans = step_spans(overlap_engine, steps - 1)
    adam = [s for s in spans if s.stage == "Adam"]
    backward = [s for s in spans if s.stage == "backward"][0]
    return "\n".join(
        [
            f"  losses equal: {serial_losses == overlap_losses}; every weight bit-identical (torch.equal): "
            f"{same_weights(weights(serial_engine), weights(overlap_engine))}",
            f"  bytes over the link, serial {pcie[0]}, overlapped {pcie[1]}",
            f"  overlapped, last step: {len(adam)} Adam calls (one a unit), the first "
            f"{1e3 * (adam[0].start - backward.end):+.1f} ms from the end of backward\n",
        ]
    )


def format_token_sweep(sweep: dict) -> str:
    """{(batch, seq_len): compare_schedules result} as a table: ms of each schedule and the two speed-ups."""
    lines = [
        f"{'batch x seq':>12}{'tokens':>8}{'serial':>9}{'overlapped':>12}{'DPU':>8}{'overlapped vs serial':>22}"
        f"{'DPU vs serial':>15}"
    ]
    for (batch, seq_len), r in sweep.items():
        ms = r["median_ms"]
        lines.append(
            f"{f'{batch} x {seq_len}':>12}{batch * seq_len:>8}{ms['serial']:>9.1f}{ms['overlapped']:>12.1f}"
            f"{ms['delayed (DPU)']:>8.1f}{r['overlapped_vs_serial']:>21.2f}x"
            f"{ms['serial'] / ms['delayed (DPU)']:>14.2f}x"
        )
    return "\n".join(lines)


def plot_token_sweep(sweep: dict, adam_ms: float, model: str) -> plt.Figure:
    """ms per step of each schedule against tokens a step, with the CPU Adam of one step as a flat line."""
    tokens = [b * s for b, s in sweep]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for name, style in (("serial", "o-"), ("overlapped", "s-"), ("delayed (DPU)", "^-")):
        ax.plot(tokens, [r["median_ms"][name] for r in sweep.values()], style, label=name)
    ax.axhline(adam_ms, color="gray", linestyle="--", linewidth=1, label=f"CPU Adam alone ({adam_ms:.0f} ms)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(tokens, [f"{b}x{s}" for b, s in sweep])
    ax.set_xlabel("tokens a step (batch x sequence length)")
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"TinyGPT('{model}'), split cores: the device's work grows, Adam's does not")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return fig
