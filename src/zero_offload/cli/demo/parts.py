"""The six parts of `make demo`, each printing what it shows and returning what the report needs.

Parts 0, 1, 2 and 4 run on every rank and print on rank 0; `machine_parts` (3 and 5) measures this one
machine on one process. run.py runs them in order; report.py writes the report from their results.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import torch
from tqdm import tqdm

from ...accelerator import DeviceOutOfMemoryError, EmulatedAccelerator
from ...basics.memory import estimate_model_states
from ...config import ConfigError, load_config
from ...engine import initialize
from ...plots import plot_losses, plot_model_states
from ...units import format_bytes, format_gb
from ...workloads import ByteBatches, GPTConfig, TinyGPT, lm_loss, load_corpus

# The course introduction's example, in substance: it pairs offload_param with stage 2.
INTRODUCTION_CONFIG = {
    "train_batch_size": 64,
    "fp16": {"enabled": True},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
    },
}
# Parts 1, 2 and 4: about 38M parameters, 600 MB of fp16 Adam states at stage 0, against a 512 MB device.
MODEL = GPTConfig(seq_len=64, d_model=512, n_layer=12, n_head=8)
QUICK_MODEL = GPTConfig(seq_len=32, d_model=128, n_layer=4, n_head=4)  # tests: the same story at 64 MB


def say(*lines) -> None:
    if _rank() == 0:
        print(*lines, sep="\n", flush=True)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _section(title: str) -> None:
    say(f"\n{'=' * 100}\n{title}\n{'=' * 100}")


def arithmetic(out: Path) -> dict:
    """Part 0: a 13B model's states per tier, and the introduction's config refused with the reason."""
    _section("0. The arithmetic: a 13B-parameter model, fp16 Adam, per GPU")
    n = 13_000_000_000
    configs = {
        "stage 0, 1 GPU": dict(stage=0),
        "stage 2 + offload, 1 GPU": dict(stage=2, offload_optimizer="cpu"),
        "stage 3, 8 GPUs": dict(stage=3, world_size=8),
        "stage 3 + offload, 8 GPUs": dict(
            stage=3, world_size=8, offload_optimizer="cpu", offload_param="cpu"
        ),
    }
    estimates = {label: estimate_model_states(n, **kw) for label, kw in configs.items()}
    say(
        f"{'configuration':<28}{'device':>12}{'host':>12}",
        *(f"{k:<28}{format_gb(e.device):>12}{format_gb(e.host):>12}" for k, e in estimates.items()),
        "16 bytes a parameter: 2 (fp16 weight) + 2 (fp16 gradient) + 4 (fp32 master) + 4 + 4 (Adam m, v).",
        f"The course introduction counts 13 x 12 = 156 GB: it forgets the fp32 master weights ({format_gb(4 * n)}).",
    )
    try:
        load_config(INTRODUCTION_CONFIG)
        refused = "accepted (it should not be)"
    except ConfigError as err:
        refused = str(err)
    say("The introduction's config, offload_param with stage 2:", f"ConfigError: {refused}")
    if _rank() == 0:
        plot_model_states(
            estimates,
            out / "memory_13b.png",
            capacity=80e9,
            title="13B parameters, fp16 Adam: model states per GPU",
        )
    return {"estimates": {k: v.as_dict() for k, v in estimates.items()}, "introduction": refused}


def _config(batch: int, zero: dict, budget: int, **extension) -> dict:
    return {
        "train_batch_size": batch,
        "fp16": {"enabled": True, "initial_scale_power": 12},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"reduce_bucket_size": 2_000_000, "overlap_comm": True, **zero},
        "zero_offload": {"device_memory": budget, **extension},
    }


def out_of_memory(cfg: GPTConfig, budget: int) -> str:
    """Part 1: stage 0 cannot hold the model states in the budget."""
    need = estimate_model_states(cfg.num_params(), precision="fp16").device
    _section(
        f"1. Stage 0: a {cfg.num_params() / 1e6:.1f}M-parameter GPT needs {format_bytes(need)} of model "
        f"states on each device; the device has {format_bytes(budget)}"
    )
    try:
        initialize(TinyGPT(cfg), _config(8, {"stage": 0}, budget), accelerator=EmulatedAccelerator(budget))
    except DeviceOutOfMemoryError as err:
        say(f"OutOfMemoryError: {err}")
        return str(err)
    raise AssertionError("stage 0 should not fit the budget")


OFFLOAD = {"stage": 2, "offload_optimizer": {"device": "cpu"}}


def offload_trains(cfg: GPTConfig, budget: int, out: Path, *, steps: int, batch: int = 4) -> dict:
    """Part 2: ZeRO-2 + CPU offload (the overlapped pipeline) trains the same model in the same budget."""
    ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))  # torchrun's count of nodes
    _section(
        f"2. The same model, ZeRO-2 + CPU offload on {ranks} rank(s) on {nodes} node(s), same "
        f"{format_bytes(budget)} device"
    )
    engine = initialize(
        TinyGPT(cfg),
        _config(batch, OFFLOAD, budget, overlap_offload=True),
        accelerator=EmulatedAccelerator(budget),
    )
    data = ByteBatches(load_corpus(), cfg.seq_len, seed=0)
    micro, losses = batch // ranks, []
    for step in tqdm(range(steps), desc="offloaded training", unit="step", disable=_rank() != 0):
        x, y = data.micro_batch(step, micro, rank=_rank(), world_size=ranks)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(engine.comm.sum(float(loss.detach())) / ranks)
    report = engine.memory_report()
    moved = {k: v / steps for k, v in engine.states.transfers.bytes.items()}
    say(
        str(report),
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {steps} steps; PCIe per step and rank: "
        f"{format_bytes(moved['d2h'])} down, {format_bytes(moved['h2d'])} up "
        f"({(moved['d2h'] + moved['h2d']) / report.num_params * ranks:.2f} bytes a parameter; the paper: 4)",
    )
    if _rank() == 0:
        plot_losses(
            {f"ZeRO-2 + CPU offload, {ranks} rank(s)": losses},
            out / "loss.png",
            title=f"{cfg.num_params() / 1e6:.0f}M-parameter GPT under a {format_bytes(budget)} device",
        )
    return {
        "params": engine.num_params,
        "ranks": ranks,
        "nodes": nodes,
        "steps": steps,
        "losses": losses,
        "device_peak": report.device.peak,
        "budget": budget,
        "pcie_bytes_per_step": moved,
    }


def memory_per_tier(cfg: GPTConfig, budget: int, out: Path) -> dict:
    """Part 4: one step of each configuration; the model states each tier holds on this rank, measured."""
    _section(
        f"4. Memory per tier, per rank, {cfg.num_params() / 1e6:.1f}M parameters (measured after one step)"
    )
    nvme = {"device": "nvme", "nvme_path": str(out / "nvme"), "buffer_count": 2}
    configs = {
        "stage 0": {"stage": 0},
        "ZeRO-2": {"stage": 2},
        "ZeRO-2 + CPU offload": OFFLOAD,
        "ZeRO-3 + CPU offload (params too)": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
        },
        "ZeRO-2 + NVMe offload": {"stage": 2, "offload_optimizer": nvme, "sub_group_size": 4_000_000},
    }
    measured, rows = {}, {}
    data = ByteBatches(load_corpus(), cfg.seq_len, seed=0)
    for label, zero in configs.items():
        try:
            engine = initialize(
                TinyGPT(cfg), _config(4, zero, budget), accelerator=EmulatedAccelerator(budget)
            )
            x, y = data.micro_batch(
                0, 4 // engine.comm.world_size, rank=_rank(), world_size=engine.comm.world_size
            )
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            report = engine.memory_report()
            measured[label] = report.measured
            rows[label] = {**report.measured.as_dict(), "device_peak": report.device.peak}
        except DeviceOutOfMemoryError:
            rows[label] = {"out_of_memory": True}
        finally:
            engine = None
    say(f"{'configuration':<36}{'device':>12}{'host':>12}{'NVMe':>12}{'device peak':>14}")
    for label, row in rows.items():
        if row.get("out_of_memory"):
            say(f"{label:<36}{'out of memory':>12}")
        else:
            say(
                f"{label:<36}{format_bytes(row['device']):>12}{format_bytes(row['host']):>12}"
                f"{format_bytes(row['nvme']):>12}{format_bytes(row['device_peak']):>14}"
            )
    if _rank() == 0:
        plot_model_states(
            measured,
            out / "memory_per_tier.png",
            capacity=budget,
            tiers=("device", "host", "nvme"),
            unit=2**20,
            unit_name="MiB",
            title=f"{cfg.num_params() / 1e6:.0f}M parameters: model states per tier, per rank",
        )
    return rows


def machine_parts(out: Path, budget: int, *, quick: bool) -> dict:
    """Parts 3 and 5, on one process: step times and the largest model measure this machine."""
    from ..bench.largest import host_bytes_needed, measure_in_fresh_process
    from ..bench.schedules import compare_schedules, split_cores

    # Part 5 first, in a process of its own: the 1B run needs nearly all of this machine's memory.
    gc.collect()
    largest = measure_in_fresh_process(budget, quick=quick)

    _section("3. Serial vs overlapped vs delayed (DPU) offload: step time, batch 1 (optimizer-heavy)")
    schedules = {}
    for cores in ("split", "shared") if split_cores() else ("shared",):
        r = compare_schedules(
            "nano" if quick else "10m",
            seq_len=8,
            rounds=2 if quick else 5,
            steps=2 if quick else 4,
            cores=cores,
            out_dir=out,
        )
        schedules[cores] = {k: v for k, v in r.items() if k != "losses"}
        say(
            f"{cores} cores: "
            + ", ".join(f"{k} {v:.0f} ms" for k, v in r["median_ms"].items())
            + f"; overlapped / serial {r['overlapped_vs_serial']:.2f}x, DPU / overlapped "
            f"{r['delayed_vs_overlapped']:.2f}x; DPU at {r['of_bound']['delayed (DPU)']:.2f}x its bound "
            "(the busier side's CPU time per step)"
        )
    _section(f"5. The largest model that trains under {format_bytes(budget)}, without and with offload")
    plain, offloaded = largest["without"], largest["with"]
    say(
        f"without offload (stage 0, bf16): {plain['params'] / 1e6:.1f}M parameters trains "
        f"(d_model {plain['d_model']}, {plain['n_layer']} layers); the next width: {plain['next_oom']}"
    )
    if offloaded["model"] == "100m":
        say(
            f"1B needs {format_bytes(host_bytes_needed('1b'))} of free host memory, more than there was: "
            "the 100M preset was trained instead"
        )
    say(
        f"with stage 3 + param and optimizer offload: {offloaded['params'] / 1e6:,.0f}M parameters, losses "
        + " -> ".join(f"{v:.3f}" for v in offloaded["losses"])
        + f", device peak {format_bytes(offloaded['device_peak'])}, host {format_bytes(offloaded['host_bytes'])}; "
        f"{offloaded['params'] / plain['params']:.0f}x the largest model without offload; Adam's moments in "
        f"{offloaded['moments']} on the host"
    )
    capacity = largest.get("host_capacity")
    if capacity:
        say(host_capacity_line(capacity))
    else:
        say("the C Adam could not be built here, so the moments stayed fp32 (8-bit moments need it)")
    return {"schedules": schedules, "largest": largest}


def host_capacity_line(capacity: dict) -> str:
    """What the 8-bit moments buy on this host, from host_capacity()'s measurement."""
    fp32, int8 = capacity["fp32"], capacity["int8"]
    line = (
        f"host bytes a parameter ({capacity['model']}, stage 3 + offload, measured): "
        f"{fp32['host_bytes_per_param']:.2f} with fp32 moments, {int8['host_bytes_per_param']:.2f} with int8 "
        f"(optimizer states {fp32['optimizer_bytes_per_param']:.3f} -> {int8['optimizer_bytes_per_param']:.3f})"
    )
    if capacity["available"]:
        line += (
            f"; this host's {format_bytes(capacity['available'])} free holds "
            f"{fp32['params_this_host_holds'] / 1e9:.2f}B parameters with fp32 moments, "
            f"{int8['params_this_host_holds'] / 1e9:.2f}B with int8"
        )
    return line + f": {capacity['more_params']:.2f}x the parameters"
