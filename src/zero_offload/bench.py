"""`make bench`: speed measured as ratios within one run (never as pass/fail timing in tests)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import initialize
from .accelerator import EmulatedAccelerator
from .basics.adam import Adam
from .plots import plot_bars
from .tuning.build import CompilerNotFound, build
from .tuning.cpu_adam import CPUAdam, adam_update
from .workloads import TinyGPT, gpt_config, lm_loss


def _median_ms(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def adam_implementations(numel: int = 16_700_000, repeats: int = 10, threads: int | None = None) -> dict:
    """One Adam step over `numel` fp32 parameters in one tensor, for each implementation in this release."""
    if threads:
        torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(numel, generator=gen)
    makers = {
        "naive (zero_offload.basics.Adam)": lambda p: Adam([p], lr=1e-3),
        "torch.optim.Adam foreach": lambda p: torch.optim.Adam([p], lr=1e-3, foreach=True),
        "torch.optim.Adam fused": lambda p: torch.optim.Adam([p], lr=1e-3, fused=True),
    }
    for variant in _c_variants():
        makers[f"C CPU Adam, {variant}"] = lambda p, v=variant: CPUAdam([p], lr=1e-3, adamw=False, variant=v)
    results = {}
    for name, make in tqdm(makers.items(), desc="Adam implementations", unit="impl"):
        param = torch.zeros(numel, requires_grad=True)
        param.grad = grad
        optimizer = make(param)
        results[name] = _median_ms(optimizer.step, repeats)
    # Memory-bandwidth floor: a fused step reads p, g, m, v and writes p, m, v = 28 bytes per parameter.
    src, dst = torch.empty(numel * 7), torch.empty(numel * 7)
    copy_ms = _median_ms(lambda: dst.copy_(src), repeats)  # reads 28 and writes 28 bytes per parameter
    floor_ms = copy_ms / 2
    return {"numel": numel, "threads": torch.get_num_threads(), "median_ms": results, "floor_ms": floor_ms}


def _c_variants() -> list[str]:
    try:
        supported = build().lib.zo_cpu_variants()
    except CompilerNotFound:
        return []
    return [name for bit, name in ((0, "scalar"), (1, "avx2")) if supported & (1 << bit)]


def offload_update(numel: int = 16_700_000, repeats: int = 10) -> dict:
    """The whole offloaded update: fp16 gradients in, the loss-scale factor applied, Adam, fp16 weights out.

    torch does it in passes (upcast, scale, fused Adam, downcast: about twice the 28 bytes a parameter of
    one pass); the C kernel reads and writes each element once.
    """
    gen = torch.Generator().manual_seed(0)
    grad16 = torch.randn(numel, generator=gen).half()
    out16 = torch.empty(numel, dtype=torch.float16)
    param = torch.zeros(numel, requires_grad=True)
    fused = torch.optim.Adam([param], lr=1e-3, fused=True)

    def torch_pipeline():
        param.grad = grad16.float().mul_(1 / 1024)
        fused.step()
        out16.copy_(param.detach())

    results = {"torch: upcast, scale, fused Adam, downcast": _median_ms(torch_pipeline, repeats)}
    if _c_variants():
        master, m, v = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
        steps = iter(range(1, 10**6))

        def one_pass():
            adam_update(master, grad16, m, v, step=next(steps), lr=1e-3, grad_scale=1 / 1024, out=out16)

        results["C CPU Adam, one pass"] = _median_ms(one_pass, repeats)
    return {"numel": numel, "median_ms": results}


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
        medians["PyTorch, fused AdamW"].append(_median_ms(plain_step, steps, warmup=1))
        medians["zero_offload, ZeRO-2 + CPU offload"].append(_median_ms(engine_step, steps, warmup=1))
    ms = {name: statistics.median(values) for name, values in medians.items()}
    ratio = ms["zero_offload, ZeRO-2 + CPU offload"] / ms["PyTorch, fused AdamW"]
    return {"model": model, "params": cfg.num_params(), "batch": batch, "median_ms": ms, "ratio": ratio}


def run_bench(out_dir: str | Path = "out/bench", *, numel: int = 16_700_000, repeats: int = 10) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    adam = adam_implementations(numel, repeats)
    fused = adam["median_ms"]["torch.optim.Adam fused"]
    print(
        f"\nAdam step over {adam['numel']:,} fp32 parameters, {adam['threads']} threads, median of {repeats}"
    )
    print(f"{'implementation':<36}{'ms':>10}{'x fused':>10}{'Mparam/s':>12}")
    for name, ms in adam["median_ms"].items():
        print(f"{name:<36}{ms:>10.1f}{ms / fused:>10.2f}{adam['numel'] / ms / 1e3:>12.0f}")
    print(
        f"{'memory-bandwidth floor (28 B/param)':<36}{adam['floor_ms']:>10.1f}{adam['floor_ms'] / fused:>10.2f}"
    )
    plot_bars(
        {**adam["median_ms"], "bandwidth floor": adam["floor_ms"]},
        out / "adam_step.png",
        title=f"Adam step, {adam['numel'] / 1e6:.1f}M params, {adam['threads']} threads",
        ylabel="ms (median)",
    )
    update = offload_update(numel, repeats)
    print(f"\nOffloaded update over {numel:,} parameters (fp16 gradients in, fp16 weights out), median")
    baseline = update["median_ms"]["torch: upcast, scale, fused Adam, downcast"]
    for name, ms in update["median_ms"].items():
        print(f"{name:<44}{ms:>8.1f} ms{baseline / ms:>8.2f}x")
    overhead = offload_overhead()
    print(
        f"\nTraining step, {overhead['params'] / 1e6:.1f}M-parameter GPT, batch {overhead['batch']}, fp32, 1 rank"
    )
    for name, ms in overhead["median_ms"].items():
        print(f"{name:<40}{ms:>10.0f} ms")
    print(f"{'offload / plain':<40}{overhead['ratio']:>10.3f}x   (target <= 1.10x; DeepSpeed measured 1.20x)")
    results = {"adam": adam, "offload_update": update, "offload_overhead": overhead}
    (out / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(f"\nresults: {out / 'results.json'}, plot: {out / 'adam_step.png'}")
    return results
