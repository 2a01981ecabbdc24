"""`make demo`: the instructor's end-to-end demonstration, with real numbers and plots under out/demo/.

    0. the arithmetic: a 13B model's states per tier, and the course introduction's config refused
    1. stage 0 runs out of the emulated device's budget
    2. ZeRO-2 with CPU offload fits the same budget, and the loss falls
    3. serial vs overlapped vs delayed (DPU) step times, with their timelines
    4. memory per tier (device, host, NVMe) for each configuration
    5. the largest model that trains under the budget, without and with offload

Parts 1, 2 and 4 run on every rank (2 by default, under torchrun on loopback); parts 3 and 5 measure this one
machine and run on rank 0 alone, after the others have left. `make demo-multinode` runs the same over two
torchrun "nodes" on loopback.

This file runs the parts in order, under torchrun when asked; the parts are parts.py, the report
report.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch

from ...units import parse_bytes
from .parts import (
    INTRODUCTION_CONFIG,
    MODEL,
    QUICK_MODEL,
    arithmetic,
    machine_parts,
    memory_per_tier,
    offload_trains,
    out_of_memory,
)
from .report import write_report

__all__ = ["INTRODUCTION_CONFIG", "run_demo"]  # lesson 3 imports the introduction's config from here


def run_demo(
    out_dir: str | Path = "out/demo",
    *,
    ranks: int = 2,
    budget: int | str = "512MiB",
    steps: int = 20,
    quick: bool = False,
    ranks_only: bool = False,
) -> Path:
    """Run the demo (under torchrun with `ranks` processes unless already launched) and return the report.

    `ranks_only`: parts 0-2 and 4, saved to results.json, for the launcher to finish with parts 3 and 5."""
    out, budget = Path(out_dir), parse_bytes(budget)
    if quick:  # the quick model's stage-0 states take 13 MiB: a budget it cannot fit, as 512 MB for MODEL
        budget = min(budget, 10 * 2**20)
    if ranks > 1 and "RANK" not in os.environ:
        results = _launch(out, ranks=ranks, budget=budget, steps=steps, quick=quick)
    else:
        results = _ranks_parts(out, budget, steps=steps, quick=quick)
        if ranks_only or _rank_from_env() != 0:
            return out / "report.md"
    # Parts 3 and 5 measure this machine: one process, all cores, and (the 1B run) nearly all its memory.
    torch.set_num_threads(os.cpu_count() or 1)
    results.update(machine_parts(out, budget, quick=quick))
    path = write_report(out, results)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
    print(f"\nReport: {path.resolve()} (plots beside it)")
    return path


def _ranks_parts(out: Path, budget: int, *, steps: int, quick: bool) -> dict:
    """Parts 0, 1, 2 and 4 on every rank; rank 0 saves their results."""
    out.mkdir(parents=True, exist_ok=True)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from ...principles.process_group import init_distributed

        init_distributed()
        torch.set_num_threads(1)  # the ranks share this machine's cores
    model = QUICK_MODEL if quick else MODEL
    results = {
        "arithmetic": arithmetic(out),
        "out_of_memory": out_of_memory(model, budget),
        "offload": offload_trains(model, budget, out, steps=steps),
        "memory": memory_per_tier(model, budget, out),
    }
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if _rank_from_env() == 0:
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
    return results


def _rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


def _launch(out: Path, *, ranks: int, budget: int, steps: int, quick: bool) -> dict:
    """Parts 0-2 and 4 under torchrun; what rank 0 saved."""
    from ...principles.process_group import free_port
    from ..launch import torchrun_command

    # zero_offload.cli.launch is torchrun with its rendezvous store listening on 127.0.0.1 only, not every interface.
    command = torchrun_command(["-m", "zero_offload.cli", "demo", "--out", str(out), "--budget", str(budget),
                                "--steps", str(steps), "--ranks-only"], port=free_port(), nproc=ranks)  # fmt: skip
    code = subprocess.run(command + (["--quick"] if quick else [])).returncode
    if code != 0:
        raise SystemExit(f"the demo failed (exit code {code}); the rank that failed printed why, above")
    return json.loads((out / "results.json").read_text(encoding="utf-8"))
