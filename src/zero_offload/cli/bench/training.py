"""Two `make bench` sections that time whole training steps:

  offload_overhead()  one rank's training step, plain PyTorch against the engine with ZeRO-2 + CPU offload;
  module5_bench()     module 5's claims: the largest model a small device trains with and without offload,
                      and the serial, overlapped and delayed (DPU) schedules on split and shared cores.

Both train the course's tiny GPT (workloads.py) with the engine on the emulated device.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from ...accelerator import EmulatedAccelerator
from ...engine import initialize
from ...workloads import TinyGPT, gpt_config, lm_loss
from .timing import median_ms, wait_until_quiet


def offload_overhead(model: str = "10m", batch: int = 8, steps: int = 8) -> dict:
    """A training step (forward, backward, Adam) of plain PyTorch with fused AdamW against the engine with
    ZeRO-2 + CPU offload, fp32, one rank, same model and batch. On the emulated device both run on the CPU, so
    the ratio is the engine's own overhead: buckets, the host copies, the upload."""
    cfg = gpt_config(model)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    hyper = {"lr": 1e-3, "weight_decay": 0.01}

    plain = TinyGPT(cfg)
    optimizer = torch.optim.AdamW(plain.parameters(), fused=True, **hyper)

    def plain_step():
        optimizer.zero_grad(set_to_none=False)
        lm_loss(plain(x), x).backward()
        optimizer.step()

    config = {
        "train_batch_size": batch,
        "optimizer": {"type": "AdamW", "params": hyper},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    engine = initialize(TinyGPT(cfg), config, accelerator=EmulatedAccelerator())

    def engine_step():
        engine.backward(lm_loss(engine(x), x))
        engine.step()

    medians = {"PyTorch, fused AdamW": [], "zero_offload, ZeRO-2 + CPU offload": []}
    for _ in tqdm(range(3), desc="offload overhead", unit="round"):  # alternate: drift hits both alike
        medians["PyTorch, fused AdamW"].append(median_ms(plain_step, steps, warmup=1))
        medians["zero_offload, ZeRO-2 + CPU offload"].append(median_ms(engine_step, steps, warmup=1))
    ms = {name: statistics.median(values) for name, values in medians.items()}
    ratio = ms["zero_offload, ZeRO-2 + CPU offload"] / ms["PyTorch, fused AdamW"]
    return {"model": model, "params": cfg.num_params(), "batch": batch, "median_ms": ms, "ratio": ratio}


def print_offload_overhead(overhead: dict) -> None:
    print(
        f"\nTraining step, {overhead['params'] / 1e6:.1f}M-parameter GPT, batch {overhead['batch']}, fp32, 1 rank"
    )
    for name, ms in overhead["median_ms"].items():
        print(f"{name:<40}{ms:>10.0f} ms")
    print(f"{'offload / plain':<40}{overhead['ratio']:>10.3f}x   (target <= 1.10x)")


def print_schedules(key: str, r: dict) -> None:
    """One compare_schedules result: each schedule's wall time, the sides' busy times, the bound, and where the
    device's thread spent the rest of the step: blocked on events, or (the rest) waiting for the GIL or a core."""
    print(f"  {key}:")
    for name, ms in r["median_ms"].items():
        busy = r["busy_ms"][name]
        rest = r["mean_ms"][name] - busy["device"] - busy["waited"]
        print(
            f"    {name:<14} {ms:>6.1f} ms   busy device {busy['device']:>6.1f} / host {busy['host']:>6.1f}   "
            f"bound {r['bound_ms'][name]:>6.1f}   wall/bound {r['of_bound'][name]:.2f}   "
            f"device waited {busy['waited']:>5.1f} + rest {rest:>5.1f}"
        )
    serial, overlapped, delayed = (r["median_ms"][k] for k in ("serial", "overlapped", "delayed (DPU)"))
    print(
        f"    overlapped/serial {r['overlapped_vs_serial']:.2f}x, DPU/overlapped {r['delayed_vs_overlapped']:.2f}x, "
        f"DPU/serial {serial / delayed:.2f}x (medians: {serial / overlapped:.2f}x, {overlapped / delayed:.2f}x)"
    )


def module5_bench(out: Path, *, budget: int = 512 * 2**20) -> dict:
    """Module 5: the largest model under `budget` with and without offload (first, in a process of its own: the
    1B run needs nearly all of this machine's memory), then serial vs overlapped vs DPU, split and shared cores."""
    from .largest import host_bytes_needed, measure_in_fresh_process
    from .schedules import compare_schedules, split_cores

    largest = measure_in_fresh_process(budget)
    plain, offloaded = largest["without"], largest["with"]
    ratio = offloaded["params"] / plain["params"]
    if offloaded["model"] != "1b":
        print(
            f"(1B needs {host_bytes_needed('1b') / 2**30:.1f} GiB of free host memory, more than there was: "
            "measured the 100M preset)"
        )
    losses = " -> ".join(f"{v:.3f}" for v in offloaded["losses"])
    print(
        f"\nLargest model under a {budget / 2**20:.0f} MiB device: {plain['params'] / 1e6:.1f}M without offload; "
        f"{offloaded['params'] / 1e6:,.0f}M with stage 3 + param and optimizer offload (losses {losses}"
        f", {offloaded['seconds']:.0f} s, host {offloaded['host_bytes'] / 2**30:.1f} GiB): {ratio:.0f}x "
        "(target >= 10x; the paper: 13B vs 1.4B on a 32 GB V100)"
    )
    waited = wait_until_quiet()
    print(f"(waited {waited:.0f} s for the machine to go quiet after the 1B run before timing the schedules)")
    schedules = {}
    print(
        "\nOffload schedules, 10.8M-parameter GPT, batch 1 x 8 tokens (optimizer-heavy), median ms per step "
        "(speed-ups: median of 8 rounds' own ratios);"
        "\nbusy: CPU ms per step of the device's thread / of the host's threads; bound: the shortest step that"
        " work allows (cli/bench/busy.py); wall / bound: 1.00 is a step that hides everything;"
        "\ndevice waited: ms per step its thread was blocked on events; rest: mean wall - busy - waited, the time it"
        " was runnable but not running (the GIL: every thread's hooks and queues are Python)"
    )
    # 4 staging slots, then the same with double buffering only and with 16, to show what slots buy (with 16,
    # backward seldom waits for a copy: what is left of the gap is the rest); last, the host-bound regime: the C
    # Adam's scalar loop stands in for a CPU whose step is longer than forward + backward.
    runs = [("split", 4, "widest"), ("shared", 4, "widest"), ("split", 2, "widest"), ("split", 16, "widest")]
    runs.append(("split", 4, "scalar"))
    if split_cores() is None:
        runs = [("shared", 4, "widest"), ("shared", 2, "widest"), ("shared", 4, "scalar")]
    for cores, slots, variant in runs:
        # 8 rounds: one round's ratio varies by +-15% on this machine; the median of 8 settles. 8 steps a turn:
        # a turn's first step has no delayed update in flight behind it (the last turn landed it).
        plots = out if (slots, variant) == (4, "widest") else None
        r = compare_schedules(
            "10m", seq_len=8, steps=8, rounds=8, cores=cores, slots=slots, variant=variant, out_dir=plots
        )
        key = f"{cores}, {slots} slots" + (", scalar C Adam (host-bound)" if variant == "scalar" else "")
        schedules[key] = {k: v for k, v in r.items() if k != "losses"}
        print_schedules(key, r)
    print(
        "(targets, split cores, batch 1 x 8: overlapped >= 1.3x serial, DPU faster than overlapped and within 5% "
        "of its bound; sharing both cores, the phases compete and the gains are smaller; with 2 staging slots "
        "backward waits whenever the host falls two units behind. Host-bound (the host busier than the device): "
        "DPU >= 1.3x serial and >= 1.1x overlapped, since only it hides the CPU's step behind forward too)"
    )
    return {"schedules": schedules, "largest": {**largest, "ratio": ratio}}
