"""`make demo`: the instructor's end-to-end demonstration, with real numbers and plots under out/demo/."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import initialize
from .accelerator import DeviceOutOfMemoryError, EmulatedAccelerator
from .basics.memory import estimate_model_states
from .config import ConfigError, load_config
from .plots import plot_losses, plot_model_states
from .units import format_bytes, format_gb
from .workloads import ByteBatches, TinyGPT, gpt_config, lm_loss, load_corpus

# The course introduction's example, verbatim in substance: it pairs offload_param with stage 2.
INTRODUCTION_CONFIG = {
    "train_batch_size": 64,
    "fp16": {"enabled": True},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
    },
}


def _section(title: str) -> None:
    print(f"\n{'=' * 100}\n{title}\n{'=' * 100}")


def thirteen_billion(out: Path) -> dict:
    """Part 1: the arithmetic of a 13B model, per tier, for the configurations the course compares."""
    _section("1. Model states of a 13B-parameter model (fp16 Adam), per GPU")
    n = 13_000_000_000
    configs = {
        "stage 0, 1 GPU": dict(stage=0),
        "stage 2 + offload, 1 GPU": dict(stage=2, offload_optimizer="cpu"),
        "stage 2, 8 GPUs": dict(stage=2, world_size=8),
        "stage 3, 8 GPUs": dict(stage=3, world_size=8),
        "stage 3 + offload, 8 GPUs": dict(
            stage=3, world_size=8, offload_optimizer="cpu", offload_param="cpu"
        ),
    }
    estimates = {label: estimate_model_states(n, **kw) for label, kw in configs.items()}
    print(f"{'configuration':<28}{'device':>12}{'host':>12}")
    for label, est in estimates.items():
        print(f"{label:<28}{format_gb(est.device):>12}{format_gb(est.host):>12}")
    print("16 bytes a parameter: 2 (fp16 weight) + 2 (fp16 gradient) + 4 (fp32 master) + 4 + 4 (Adam m, v).")
    print(
        f"The course introduction says 13 x 12 = 156 GB: it forgets the fp32 master weights "
        f"({format_gb(4 * n)}). Measured below on a real model."
    )
    plot = plot_model_states(
        estimates,
        out / "memory_13b.png",
        capacity=80e9,
        title="13B parameters, fp16 Adam: model states per GPU",
    )
    return {"estimates": {k: v.as_dict() for k, v in estimates.items()}, "plot": plot.name}


def introduction_config() -> str:
    """Part 2: the introduction's config is rejected, with the reason."""
    _section("2. The course introduction's config: offload_param with stage 2")
    try:
        load_config(INTRODUCTION_CONFIG)
    except ConfigError as err:
        print(f"ConfigError: {err}")
        return str(err)
    raise AssertionError("the introduction's config should have been rejected")


def out_of_memory(budget: int) -> str:
    """Part 3: stage 0 under a device budget smaller than its model states runs out of memory."""
    cfg = gpt_config("small")
    need = estimate_model_states(cfg.num_params(), precision="fp16").device
    _section(
        f"3. Stage 0: a {cfg.num_params() / 1e6:.1f}M-parameter GPT needs {format_bytes(need)} of model "
        f"states; the device has {format_bytes(budget)}"
    )
    model = TinyGPT(cfg)
    try:
        initialize(
            model, {"train_batch_size": 8, "fp16": {"enabled": True}}, accelerator=EmulatedAccelerator(budget)
        )
    except DeviceOutOfMemoryError as err:
        print(f"OutOfMemoryError: {err}")
        return str(err)
    raise AssertionError("stage 0 should not fit the budget")


def _train_config(batch: int, zero: dict) -> dict:
    return {
        "train_batch_size": batch,
        "fp16": {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 50},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
        # torch's fused Adam on both sides, so the offloaded run must match the device run bit for bit: offload
        # moves the states, not the arithmetic (module 4's C Adam rounds a few last bits differently, and fp16
        # training would amplify that into visibly different curves).
        "zero_offload": {"cpu_adam": {"impl": "torch"}},
    }


OFFLOAD = {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 2_000_000}


def _run(engine, cfg, steps: int, batch: int, desc: str) -> tuple[list[float], float]:
    data = ByteBatches(load_corpus(), cfg.seq_len)
    losses = []
    started = time.perf_counter()
    with tqdm(range(steps), desc=desc, unit="step") as bar:
        for step in bar:
            x, y = data.global_batch(step, batch)
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}", scale=f"{engine.scaler.scale:g}")
    return losses, (time.perf_counter() - started) / steps


def offload_fits(budget: int, *, steps: int, batch: int = 8) -> dict:
    """Part 4: the model that did not fit at stage 0 trains with ZeRO-2 + CPU offload in the same budget."""
    cfg = gpt_config("small")
    _section(
        f"4. The same {cfg.num_params() / 1e6:.1f}M-parameter GPT with ZeRO-2 + CPU offload, same "
        f"{format_bytes(budget)} device: the fp32 half of the states moves to the host"
    )
    accel = EmulatedAccelerator(budget)
    engine = initialize(TinyGPT(cfg), _train_config(batch, OFFLOAD), accelerator=accel)
    losses, seconds = _run(engine, cfg, steps, batch, "offloaded training")
    report = engine.memory_report()
    print(report)
    moved = engine.states.transfers.bytes
    per_step = {k: v / steps for k, v in moved.items()}
    adam_ms = 1000 * sum(r["adam_seconds"] for r in engine.history) / steps
    print(
        f"PCIe per step: {format_bytes(per_step['d2h'])} device->host (fp16 gradients), "
        f"{format_bytes(per_step['h2d'])} host->device (fp16 weights) = "
        f"{(per_step['d2h'] + per_step['h2d']) / engine.num_params:.2f} bytes a parameter (the paper: 4)"
    )
    print(
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {steps} steps, {seconds * 1000:.0f} ms/step, of which "
        f"the CPU Adam {adam_ms:.0f} ms; device peak {format_bytes(report.device.peak)} of {format_bytes(budget)}"
    )
    return {
        "params": engine.num_params,
        "steps": steps,
        "ms_per_step": seconds * 1000,
        "adam_ms_per_step": adam_ms,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "pcie_bytes_per_step": per_step,
        "memory": {
            "estimated": report.estimated.as_dict(),
            "measured": report.measured.as_dict(),
            "device_peak": report.device.peak,
            "budget": budget,
        },
    }


def train(out: Path, *, steps: int, budget: int, model_name: str = "tiny", batch: int = 8) -> dict:
    """Part 5: a longer run, on the device and offloaded, from the same weights: the same loss curve."""
    cfg = gpt_config(model_name)
    _section(
        f"5. Training a {cfg.num_params() / 1e6:.2f}M-parameter GPT on the course text, fp16, "
        f"{steps} steps: stage 0 on the device, then ZeRO-2 + CPU offload"
    )
    runs = {}
    for label, zero in (("stage 0 (device)", {"stage": 0}), ("stage 2 + CPU offload", OFFLOAD)):
        torch.manual_seed(0)
        engine = initialize(TinyGPT(cfg), _train_config(batch, zero), accelerator=EmulatedAccelerator(budget))
        losses, seconds = _run(engine, cfg, steps, batch, label)
        runs[label] = {"engine": engine, "losses": losses, "seconds": seconds}
    device, offloaded = runs.values()
    report = offloaded["engine"].memory_report()
    print(report)
    gap = max(abs(a - b) for a, b in zip(device["losses"], offloaded["losses"], strict=True))
    for label, run in runs.items():
        losses = run["losses"]
        print(
            f"{label:<24} loss {losses[0]:.3f} -> {losses[-1]:.3f}, {run['seconds'] * 1000:.0f} ms/step, "
            f"{run['engine'].skipped_steps} steps skipped on fp16 overflow"
        )
    print(f"largest loss difference between the two runs: {gap:.2e} (anything above 0 is fp16 rounding)")
    plot = plot_losses(
        {label: run["losses"] for label, run in runs.items()},
        out / "loss.png",
        title="Tiny GPT on the course text: device vs CPU offload",
    )
    return {
        "params": offloaded["engine"].num_params,
        "steps": steps,
        "ms_per_step": {label: run["seconds"] * 1000 for label, run in runs.items()},
        "loss_first": offloaded["losses"][0],
        "loss_last": offloaded["losses"][-1],
        "max_loss_gap": gap,
        "skipped_steps": offloaded["engine"].skipped_steps,
        "memory": {
            "estimated": report.estimated.as_dict(),
            "measured": report.measured.as_dict(),
            "device_peak": report.device.peak,
            "budget": budget,
        },
        "plot": plot.name,
    }


def write_report(out: Path, results: dict) -> Path:
    part1, fits, part5 = results["thirteen_billion"], results["offload_fits"], results["training"]
    lines = [
        "# zero-offload demo report",
        "",
        "## 1. Model states of a 13B model",
        "",
        "| configuration | device | host |",
        "|---|---|---|",
        *(
            f"| {k} | {format_gb(v['device'])} | {format_gb(v['host'])} |"
            for k, v in part1["estimates"].items()
        ),
        "",
        f"![13B model states]({part1['plot']})",
        "",
        "## 2. The introduction's config",
        "",
        "```",
        results["introduction_config"],
        "```",
        "",
        "## 3. Stage 0 out of memory",
        "",
        "```",
        results["out_of_memory"],
        "```",
        "",
        "## 4. ZeRO-2 + CPU offload in the same budget",
        "",
        f"{fits['params']:,} parameters, {fits['steps']} steps, {fits['ms_per_step']:.0f} ms/step "
        f"(CPU Adam {fits['adam_ms_per_step']:.0f} ms); loss {fits['loss_first']:.3f} -> {fits['loss_last']:.3f}; "
        f"device peak {format_bytes(fits['memory']['device_peak'])} of {format_bytes(fits['memory']['budget'])}.",
        f"PCIe per step: {format_bytes(fits['pcie_bytes_per_step']['d2h'])} down, "
        f"{format_bytes(fits['pcie_bytes_per_step']['h2d'])} up.",
        "",
        "| tier | estimated | measured |",
        "|---|---|---|",
        *(
            f"| {t} | {format_bytes(fits['memory']['estimated'][t])} | {format_bytes(fits['memory']['measured'][t])} |"
            for t in ("device", "host", "nvme")
        ),
        "",
        "## 5. Training on the device and offloaded",
        "",
        f"{part5['params']:,} parameters, {part5['steps']} steps; "
        + ", ".join(f"{k}: {v:.0f} ms/step" for k, v in part5["ms_per_step"].items())
        + f"; loss {part5['loss_first']:.3f} -> {part5['loss_last']:.3f}; largest loss difference between the "
        f"runs {part5['max_loss_gap']:.1e}; {part5['skipped_steps']} steps skipped on fp16 overflow.",
        "",
        f"![loss]({part5['plot']})",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    (out / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    return path


def run_demo(out_dir: str | Path = "out/demo", *, steps: int = 300, offload_steps: int = 20) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "thirteen_billion": thirteen_billion(out),
        "introduction_config": introduction_config(),
        "out_of_memory": out_of_memory(budget=64 * 2**20),
        "offload_fits": offload_fits(64 * 2**20, steps=offload_steps),
        "training": train(out, steps=steps, budget=64 * 2**20),
    }
    path = write_report(out, results)
    _section(f"Report written to {path} (plots beside it)")
    return path
