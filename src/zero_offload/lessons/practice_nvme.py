"""Lesson 5, section 5: the NVMe tier measured against the CPU tier, and what a full disk does to a step."""

from __future__ import annotations

import errno
import os
import statistics
import textwrap
import time
import warnings
from pathlib import Path

from .. import initialize
from ..accelerator import EmulatedAccelerator
from ..practice.nvme import NVMeError, SwapFiles
from ..units import format_bytes
from ..workloads import ByteBatches, TinyGPT, gpt_config, lm_loss
from .practice_steps import same_weights, train_engine, weights


def nvme_config(tier: str, root: Path, *, batch: int, sub_group: int, buffers: int = 4) -> dict:
    """Stage 2, fp16, one C Adam thread; the optimizer states on the CPU or in files under root/buffers<B>."""
    offload = {"device": "cpu"}
    if tier == "nvme":
        offload = {"device": "nvme", "nvme_path": str(root / f"buffers{buffers}"), "buffer_count": buffers}
    return {
        "train_batch_size": batch,
        "fp16": {"enabled": True, "initial_scale_power": 12},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 2, "offload_optimizer": offload, "sub_group_size": sub_group},
        "zero_offload": {"cpu_adam": {"impl": "simd", "threads": 1}},
    }


def tier_runs(model: str, configs: dict, steps: int, corpus, *, batch: int) -> tuple[dict, dict]:
    """(engines, ms per step of each): one step of each tier in turn, `steps` rounds, the same data for all."""
    engines = {
        name: initialize(TinyGPT(model, seed=0), cfg, accelerator=EmulatedAccelerator())
        for name, cfg in configs.items()
    }
    data = ByteBatches(corpus, gpt_config(model).seq_len, seed=0)
    ms = {name: [] for name in engines}
    for _ in range(steps):
        for name, engine in engines.items():
            x, y = data.global_batch(engine.global_steps, batch)
            started = time.perf_counter()
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            ms[name].append((time.perf_counter() - started) * 1e3)
    return engines, ms


def format_tiers(engines: dict, ms: dict, reference: dict) -> str:
    """Per tier: sub-groups, bytes per tier, files on disk, ms a step, Adam + I/O, same weights as `reference`."""
    lines = [
        f"{'tier':<20}{'sub-groups':>11}{'host':>12}{'nvme':>12}{'staging':>11}{'files':>7}{'on disk':>12}"
        f"{'ms/step':>9}{'Adam + I/O ms':>15}{'same weights':>14}"
    ]
    for name, engine in engines.items():
        report, states = engine.memory_report(), engine.states
        files = sorted(states.files.dir.iterdir()) if hasattr(states, "files") else []
        on_disk = sum(f.stat().st_size for f in files)
        groups = len(states.groups) if hasattr(states, "groups") else "-"
        adam_ms = (
            statistics.median(h["adam_seconds"] for h in engine.history[1:]) * 1e3
        )  # step 0: fresh pages
        lines.append(
            f"{name:<20}{groups:>11}{format_bytes(report.measured.host):>12}"
            f"{format_bytes(report.measured.nvme):>12}{format_bytes(report.host_staging):>11}"
            f"{len(files):>7}{format_bytes(on_disk):>12}{statistics.median(ms[name][1:]):>9.1f}"
            f"{adam_ms:>15.1f}{str(same_weights(weights(engine), reference)):>14}"
        )
    return "\n".join(lines)


def disk_full_step(
    engine, cpu_engine, model: str, corpus, *, batch: int, nvme_root: Path, group: int = 2
) -> str:
    """Make `engine`'s write of sub-group `group` fail with ENOSPC for one step, then train on; what happened.

    Only this engine's SwapFiles instance is patched, and only for the failing step."""
    files = engine.states.files
    failing = min(group, len(engine.states.groups) - 1)

    def full_at(g, state, data):
        if g == failing and state == "master":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(files.path(g, state)))
        return SwapFiles.write(files, g, state, data)

    reference = weights(cpu_engine)
    files.write = full_at
    steps_before, lines = engine.global_steps, []
    try:
        train_engine(None, model, 1, corpus, batch=batch, engine=engine)
    except NVMeError as err:
        message = str(err).replace(str(nvme_root), "<nvme_path>")
        lines.append("NVMeError:\n" + textwrap.fill(message, 116, subsequent_indent="  "))
    finally:
        del files.write  # the class's write again
    left = len([p for p in files.dir.iterdir() if p.name.endswith(".tmp")])
    lines.append(
        f"\nglobal_steps {steps_before} -> {engine.global_steps}; weights still those of the CPU tier at "
        f"step {cpu_engine.global_steps}: {same_weights(weights(engine), reference)}; temporary files "
        f"left: {left}"
    )
    engine.zero_grad()  # drop the gradients of the step that was not taken, then train on
    with warnings.catch_warnings():
        # The failed step did not advance global_steps, so the engine's check for a backward without a step
        # fires here although zero_grad() has dropped those gradients: nothing adds up.
        warnings.filterwarnings("ignore", message="backward\\(\\) was called again", category=UserWarning)
        for e in (engine, cpu_engine):
            train_engine(None, model, 1, corpus, batch=batch, engine=e)
    lines.append(
        f"after one more step on each: the same weights as the CPU tier: "
        f"{same_weights(weights(engine), weights(cpu_engine))}"
    )
    return "\n".join(lines)
