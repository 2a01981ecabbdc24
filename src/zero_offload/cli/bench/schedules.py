"""Serial, overlapped, delayed: one training step under module 5's three schedules, timed side by side.

    serial        module 3: backward, then D2H, Adam, H2D one after the other; the device waits for the CPU
    overlapped    pipeline.py: each unit's copies and Adam start as soon as its gradient exists
    delayed       dpu.py: the CPU's Adam of step t runs during forward and backward of step t+1

The gain depends on who has which cores. A GPU and a CPU are separate processors, so on a machine with only
CPUs `cores="split"` gives the emulated device's compute (this thread, torch's ops) its own core and the host's
Adam the others. With `cores="shared"` both phases use every core; overlapping them then mostly swaps one
phase's cores for the other's, and the gain shrinks to what the serial phases left idle.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from ...accelerator import EmulatedAccelerator
from ...accelerator.streams import seconds_blocked
from ...engine import initialize
from ...practice.timeline_plots import plot_step, representative_step
from ...workloads import ByteBatches, TinyGPT, gpt_config, lm_loss, load_corpus
from .busy import Busy, cpu_seconds

SCHEDULES = {
    "serial": {},
    "overlapped": {"overlap_offload": True},
    "delayed (DPU)": {"overlap_offload": True, "delayed_param_update": {"enabled": True, "start_step": 2}},
}


def split_cores() -> tuple[list[int], list[int]] | None:
    """(device cores, host cores): the first usable core for the device, the rest for the host; None if only one."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return (usable[:1], usable[1:]) if len(usable) >= 2 else None


@contextmanager
def restored_threads():
    """The engines pin this thread and set torch's thread count; give both back afterwards."""
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def _config(
    batch: int, schedule: dict, pinned: tuple | None, impl: str, slots: int = 2, variant="widest"
) -> dict:
    extension = {"cpu_adam": {"impl": impl, "variant": variant}, **schedule}
    if schedule.get("overlap_offload"):
        extension["staging_slots"] = slots
    if pinned is not None:
        extension["cores"] = {"device": pinned[0], "host": pinned[1]}
    return {
        "train_batch_size": batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        # Buckets of about one block, reduced as soon as they fill: gradients leave while backward runs.
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu"},
            "overlap_comm": True,
            "reduce_bucket_size": 1_000_000,
        },  # fmt: skip
        "zero_offload": extension,
    }


def compare_schedules(
    model: str = "10m",
    *,
    batch: int = 1,
    seq_len: int = 32,
    steps: int = 4,
    rounds: int = 5,
    cores: str = "split",
    impl: str = "simd",
    slots: int = 4,
    variant: str = "widest",
    out_dir: str | Path | None = None,
) -> dict:
    """Median ms per step of each schedule (rounds interleaved), the losses, and each one's timeline plot (one
    typical step, zoomed).

    The speed-ups are medians of per-round ratios: this machine's speed drifts by 10-20% over seconds (a
    shared VM), and two schedules timed in the same round see the same drift.

    Small batches make the step optimizer-heavy: the device's work shrinks with the batch, Adam's does not.
    `slots`: the pipeline's staging slots (zero_offload.staging_slots); with 2 backward waits whenever the host
    falls behind for two units, which on a CPU standing in for the device happens often. `variant`: the C Adam's
    loop (zero_offload.cpu_adam.variant); "scalar" stands in for a CPU that takes longer over its step than the
    device over forward and backward."""
    if cores not in ("split", "shared"):
        raise ValueError(f"cores must be 'split' or 'shared', got {cores!r}")
    pinned = split_cores() if cores == "split" else None  # read before the first engine pins this thread
    if cores == "split" and pinned is None:
        raise RuntimeError("cores='split' needs at least two usable cores; use cores='shared'")
    cfg = gpt_config(model, seq_len=seq_len)
    data = ByteBatches(load_corpus(), seq_len, seed=0)
    with restored_threads():
        if cores == "shared":
            torch.set_num_threads(len(os.sched_getaffinity(0)))
        engines = {
            name: initialize(
                TinyGPT(cfg, seed=0),
                _config(batch, schedule, pinned, impl, slots, variant),
                accelerator=EmulatedAccelerator(),
            )  # fmt: skip
            for name, schedule in SCHEDULES.items()
        }
        done = dict.fromkeys(engines, 0)
        losses: dict[str, list[float]] = {name: [] for name in engines}
        busy = {name: Busy(0.0, 0.0) for name in engines}
        landing: dict[str, list[float]] = {name: [] for name in engines}

        def run(name: str, count: int) -> list[float]:
            """ms of each of `count` steps of schedule `name`; its CPU time is added to busy[name].

            A turn ends by landing the delayed update still in flight, so that its Adam does not run into the
            next schedule's turn. Training lands it only at a checkpoint: its wall time is kept apart
            (landing), its CPU time counts (that Adam is the last step's work), its wait does not."""
            engine, ms, cpu = engines[name], [], cpu_seconds()
            for _ in range(count):
                start = time.perf_counter()
                x, y = data.global_batch(done[name], batch)
                loss = lm_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses[name].append(float(loss.detach()))
                done[name] += 1
                ms.append((time.perf_counter() - start) * 1000)
            start, blocked = time.perf_counter(), seconds_blocked()
            engine.synchronize()
            landing[name].append((time.perf_counter() - start) * 1000)
            # The steps' waits only: what the device's thread was blocked for up to the landing.
            busy[name] = busy[name] + replace(Busy.since(cpu), waited=blocked - cpu[2])
            return ms

        for name in engines:
            run(name, 3)  # warm-up: first-touch faults, the C build, the delayed update's warm-up steps
        busy = {name: Busy(0.0, 0.0) for name in engines}
        landing = {name: [] for name in engines}
        times: dict[str, list[float]] = {name: [] for name in engines}
        by_round: list[dict[str, float]] = []  # each round's median ms per schedule
        order = list(engines)
        for _ in tqdm(range(rounds), desc=f"schedules, {cores} cores", unit="round"):
            this_round = {name: run(name, steps) for name in order}
            for name, values in this_round.items():
                times[name] += values
            by_round.append({name: statistics.median(values) for name, values in this_round.items()})
            order.reverse()  # a machine that drifts slower or faster during a round favours neither end
        plots = {}
        if out_dir is not None:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            spans = {}
            for name, engine in engines.items():
                slug = name.split()[0]
                path = out / f"timeline_{slug}_{cores}.png"
                # The trace keeps every step held; the picture shows one typical step, zoomed.
                spans[name] = engine.timeline(trace=path.with_suffix(".json"))[0]
                plot_step(
                    {name: spans[name]},
                    path,
                    step=representative_step(spans[name]),
                    title=f"{name}, {cores} cores: one typical step (the median-length one)",
                )
                plots[name] = str(path)
            # One step of each, at a scale where the overlap (or its absence) is visible.
            plots["one step"] = str(
                plot_step(spans, out / f"step_{cores}.png", title=f"one step, {cores} cores")
            )
    ms = {name: statistics.median(values) for name, values in times.items()}
    counted = rounds * steps  # the steps whose CPU time `busy` holds
    busy_ms = {
        name: {
            "device": b.device * 1e3 / counted,
            "host": b.host * 1e3 / counted,
            "waited": b.waited * 1e3 / counted,
        }
        for name, b in busy.items()
    }
    sides = (len(pinned[0]), len(pinned[1])) if pinned else (len(os.sched_getaffinity(0)), None)
    bound_ms = {name: b.bound(*sides) * 1e3 / counted for name, b in busy.items()}

    def paired(numerator: str, denominator: str) -> float:
        """The median over rounds of one schedule's time over another's, each ratio from one round."""
        return statistics.median(r[numerator] / r[denominator] for r in by_round)

    return {
        "model": model,
        "params": cfg.num_params(),
        "batch": batch,
        "seq_len": seq_len,
        "cores": cores,
        "slots": slots,
        "variant": variant,
        "median_ms": ms,
        # The mean over the same steps as busy_ms: mean - busy device - waited is what the GIL and the scheduler
        # took from the device's thread (the median can fall below the mean busy time). landing_ms: what each
        # turn's closing synchronize() took, outside the steps (a delayed update's last Adam, else nothing).
        "mean_ms": {name: statistics.fmean(values) for name, values in times.items()},
        "landing_ms": {name: statistics.median(values) for name, values in landing.items()},
        "per_round_ms": by_round,
        # CPU ms per step of the device's thread and of the host's, and ms the device's thread was blocked on
        # events (busy.py); a step's wall time minus both is what it lost to the GIL and the scheduler.
        "busy_ms": busy_ms,
        "bound_ms": bound_ms,  # the shortest step that work allows: max of the sides' busy time per core
        "of_bound": {name: ms[name] / bound_ms[name] for name in ms},  # wall time / bound (1.0: at the bound)
        "overlapped_vs_serial": paired("serial", "overlapped"),
        "delayed_vs_overlapped": paired("overlapped", "delayed (DPU)"),
        "losses": losses,
        "plots": plots,
    }
