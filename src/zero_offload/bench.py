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
from .cli import BENCH_SECTIONS as SECTIONS
from .plots import plot_bars
from .tuning.bandwidth import median_seconds
from .tuning.build import CompilerNotFound
from .tuning.cpu_adam import CPUAdam, adam_update, memory_floor, supported_variants
from .workloads import TinyGPT, gpt_config, lm_loss

BYTES_PER_PARAM = 28  # one Adam pass: w, m, v read and written (24) + the fp32 gradient read (4)


def _median_ms(fn, repeats: int, warmup: int = 2) -> float:
    return median_seconds(fn, repeats, warmup=warmup) * 1000


def _interleaved_ms(fns: dict, rounds: int, calls: int = 3, desc: str = "") -> dict[str, float]:
    """Median ms of each function. Every round times every function (`calls` calls each), so a slow spell of
    a shared machine falls on all of them alike instead of on whichever happened to run then."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm up: first-touch page faults, a compile, thread start-up
    for _ in tqdm(range(rounds), desc=desc, unit="round"):
        for name, fn in fns.items():
            times[name].append(_median_ms(fn, calls, warmup=0))
    return {name: statistics.median(values) for name, values in times.items()}


def _deepspeed_adam(param):
    """DeepSpeed's own CPU Adam, when `deepspeed` is installed: a reference, never a dependency."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam([param], lr=1e-3, adamw_mode=False)


def adam_implementations(numel: int = 16_700_000, rounds: int = 7, threads: int = 2) -> dict:
    """One Adam step over `numel` fp32 parameters in one tensor: every implementation, ours per variant and
    thread count, and the memory floor (the same bytes with no arithmetic) at `threads` threads."""
    torch.set_num_threads(threads)
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    makers = {
        "naive (basics.Adam)": lambda p: Adam([p], lr=1e-3),
        "torch foreach": lambda p: torch.optim.Adam([p], lr=1e-3, foreach=True),
        "torch fused": lambda p: torch.optim.Adam([p], lr=1e-3, fused=True),
        "DeepSpeedCPUAdam": _deepspeed_adam,
    }
    for variant in _c_variants():
        for count in range(1, threads + 1):
            makers[f"ours {variant} x{count}"] = lambda p, v=variant, t=count: CPUAdam(
                [p], lr=1e-3, adamw=False, variant=v, threads=t
            )
    steps, skipped = {}, {}
    for name, make in makers.items():
        param = torch.zeros(numel, requires_grad=True)
        param.grad = grad
        try:
            steps[name] = make(param).step
        except Exception as err:  # noqa: BLE001 - an optional reference that cannot be built is reported, not fatal
            skipped[name] = f"{type(err).__name__}: {err}".splitlines()[0][:100]
    if _c_variants():
        scratch = [torch.zeros(numel) for _ in range(3)]
        steps["memory floor"] = lambda: memory_floor(
            scratch[0], grad, scratch[1], scratch[2], threads=threads
        )
    ms = _interleaved_ms(steps, rounds, desc="Adam implementations")
    floor = ms.pop("memory floor", None)
    return {"numel": numel, "threads": threads, "median_ms": ms, "floor_ms": floor, "skipped": skipped}


def _c_variants() -> list[str]:
    try:
        return supported_variants()
    except CompilerNotFound:
        return []


def offload_update(numel: int = 16_700_000, rounds: int = 7, threads: int = 2) -> dict:
    """The whole offloaded update: fp16 gradients in, the loss-scale factor applied, Adam, fp16 weights out.

    torch does it in passes (upcast, scale, fused Adam, downcast: about twice the 28 bytes a parameter of
    one pass); the C kernel reads and writes each element once.
    """
    torch.set_num_threads(threads)
    grad16 = torch.randn(numel, generator=torch.Generator().manual_seed(0)).half()
    out16 = torch.empty(numel, dtype=torch.float16)
    param = torch.zeros(numel, requires_grad=True)
    fused = torch.optim.Adam([param], lr=1e-3, fused=True)

    def torch_pipeline():
        param.grad = grad16.float().mul_(1 / 1024)
        fused.step()
        out16.copy_(param.detach())

    steps = {"torch: upcast, scale, fused Adam, downcast": torch_pipeline}
    if _c_variants():
        master, m, v = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
        scratch = [torch.zeros(numel) for _ in range(3)]
        counter = iter(range(1, 10**6))
        steps["ours, one pass"] = lambda: adam_update(
            master, grad16, m, v, step=next(counter), lr=1e-3, grad_scale=1 / 1024, out=out16, threads=threads
        )
        steps["memory floor"] = lambda: memory_floor(
            *scratch[:1], grad16, *scratch[1:], out=out16, threads=threads
        )
    ms = _interleaved_ms(steps, rounds, desc="offloaded update")
    return {"numel": numel, "threads": threads, "median_ms": ms, "floor_ms": ms.pop("memory floor", None)}


def _print_adam(adam: dict) -> None:
    fused, floor, numel = adam["median_ms"]["torch fused"], adam["floor_ms"], adam["numel"]
    print(
        f"\nAdam step over {numel:,} fp32 parameters, {adam['threads']} threads (medians of interleaved rounds)"
    )
    print(f"{'implementation':<28}{'ms':>9}{'vs fused':>10}{'Mparam/s':>10}{'GB/s':>8}{'of floor':>10}")
    rows = dict(adam["median_ms"], **({"memory floor (no arithmetic)": floor} if floor else {}))
    for name, ms in rows.items():
        share = f"{floor / ms:>9.0%}" if floor else f"{'-':>9}"
        gbps = BYTES_PER_PARAM * numel / ms / 1e6
        print(f"{name:<28}{ms:>9.1f}{fused / ms:>9.2f}x{numel / ms / 1e3:>10.0f}{gbps:>8.1f} {share}")
    for name, why in adam["skipped"].items():
        print(f"{name:<28} skipped: {why}")
    ours = {
        n: ms
        for n, ms in adam["median_ms"].items()
        if n.startswith("ours") and n.endswith(f"x{adam['threads']}")
    }
    if ours and floor:
        best = min(ours, key=ours.get)
        print(f"best of ours ({best}): {fused / ours[best]:.2f}x torch fused (target >= 1.0x), "
              f"{floor / ours[best]:.0%} of the floor (target >= 90%)")  # fmt: skip


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


def _print_update(update: dict) -> None:
    numel = update["numel"]
    print(f"\nOffloaded update over {numel:,} parameters (fp16 gradients in, scale, Adam, fp16 weights out)")
    baseline = update["median_ms"]["torch: upcast, scale, fused Adam, downcast"]
    for name, ms in update["median_ms"].items():
        print(f"{name:<44}{ms:>8.1f} ms{baseline / ms:>8.2f}x")
    if update["floor_ms"]:
        ours = update["median_ms"]["ours, one pass"]
        print(f"{'memory floor (28 bytes a parameter)':<44}{update['floor_ms']:>8.1f} ms   one pass at "
              f"{update['floor_ms'] / ours:.0%} of it; {baseline / ours:.2f}x the torch pipeline (target >= 2.0x)")  # fmt: skip


def _print_overhead(overhead: dict) -> None:
    print(
        f"\nTraining step, {overhead['params'] / 1e6:.1f}M-parameter GPT, batch {overhead['batch']}, fp32, 1 rank"
    )
    for name, ms in overhead["median_ms"].items():
        print(f"{name:<40}{ms:>10.0f} ms")
    print(f"{'offload / plain':<40}{overhead['ratio']:>10.3f}x   (target <= 1.10x; DeepSpeed measured 1.20x)")


def run_bench(
    out_dir: str | Path = "out/bench",
    *,
    numel: int = 16_700_000,
    rounds: int = 7,
    threads: int = 2,
    only: tuple[str, ...] = SECTIONS,
):
    """Every section of `make bench` (SECTIONS, in that order), or the `only` ones: a run of some sections
    replaces their results in results.json and keeps those of the others from earlier runs."""
    from .bench_cpu import after_torch_op, model_vs_engine, print_after_torch_op, print_model_vs_engine

    if set(only) - set(SECTIONS):
        raise ValueError(f"bench sections are {', '.join(SECTIONS)}; got {', '.join(only)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    partial = set(only) != set(SECTIONS)
    results = json.loads(path.read_text(encoding="utf-8")) if partial and path.exists() else {}
    if "adam" in only:
        adam = results["adam"] = adam_implementations(numel, rounds, threads)
        _print_adam(adam)
        floor = BYTES_PER_PARAM * numel / adam["floor_ms"] / 1e6 if adam["floor_ms"] else None
        plot_bars(
            {name: BYTES_PER_PARAM * numel / ms / 1e6 for name, ms in adam["median_ms"].items()},
            out / "adam_step.png",
            title=f"Adam step, {numel / 1e6:.1f}M fp32 params, {threads} threads: memory traffic",
            ylabel="GB/s (28 bytes a parameter)",
            line=("memory floor", floor) if floor else None,
        )
    if "update" in only:
        results["offload_update"] = offload_update(numel, rounds, threads)
        _print_update(results["offload_update"])
    if "overhead" in only:
        results["offload_overhead"] = offload_overhead()
        _print_overhead(results["offload_overhead"])
    if "model" in only:
        waited = wait_until_quiet()  # the model is calibrated in one moment and checked in the next
        results["model_vs_engine"] = {**model_vs_engine(), "waited_for_quiet_s": waited}
        print_model_vs_engine(results["model_vs_engine"])
    if "torch-op" in only:
        waited = wait_until_quiet()  # "quiet" means this process's own threads only
        results["after_torch_op"] = {**after_torch_op(numel, rounds, threads), "waited_for_quiet_s": waited}
        print_after_torch_op(results["after_torch_op"])
    if "module5" in only:
        results.update(module5_bench(out))
    path.write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(f"\nresults: {path}" + (f", plot: {out / 'adam_step.png'}" if "adam" in only else ""))
    return results


def _busy_fraction(seconds: float) -> float | None:
    """The share of all cores' time spent busy over the next `seconds` (Linux /proc/stat); None elsewhere."""

    def sample():
        with open("/proc/stat") as stat:
            ticks = [int(v) for v in stat.readline().split()[1:]]
        return ticks[3] + ticks[4], sum(ticks)  # idle + iowait, total

    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except OSError:
        return None
    return 1 - (idle1 - idle0) / max(total1 - total0, 1)


def wait_until_quiet(limit: float = 90.0, threshold: float = 0.1) -> float:
    """Wait until the machine is idle (under `threshold` busy for two seconds running), at most `limit` seconds;
    the seconds waited. Once, after the 1B run exited, kernel threads (kworker) kept both cores busy for about
    20 s handing its 19 GB back: a timing started then charges that work to whichever schedule runs beside it."""
    start, quiet = time.perf_counter(), 0
    while quiet < 2 and time.perf_counter() - start < limit:
        busy = _busy_fraction(1.0)
        if busy is None:
            break
        quiet = quiet + 1 if busy < threshold else 0
    return time.perf_counter() - start


def module5_bench(out: Path, *, budget: int = 512 * 2**20) -> dict:
    """Module 5: the largest model under `budget` with and without offload (first, in a process of its own: the
    1B run needs nearly all of this machine's memory), then serial vs overlapped vs DPU, split and shared cores."""
    from .practice.largest import host_bytes_needed, measure_in_fresh_process
    from .practice.schedules import compare_schedules, split_cores

    largest = measure_in_fresh_process(budget)
    plain, offloaded = largest["without"], largest["with"]
    ratio = offloaded["params"] / plain["params"]
    if offloaded["model"] != "1b":
        print(f"(1B needs {host_bytes_needed('1b') / 2**30:.1f} GiB of free host memory, more than there was: "
              "measured the 100M preset)")  # fmt: skip
    print(f"\nLargest model under a {budget / 2**20:.0f} MiB device: {plain['params'] / 1e6:.1f}M without offload; "
          f"{offloaded['params'] / 1e6:,.0f}M with stage 3 + param and optimizer offload (losses "
          + " -> ".join(f"{v:.3f}" for v in offloaded["losses"])
          + f", {offloaded['seconds']:.0f} s, host {offloaded['host_bytes'] / 2**30:.1f} GiB): {ratio:.0f}x "
          "(target >= 10x; the paper: 13B vs 1.4B on a 32 GB V100)")  # fmt: skip
    waited = wait_until_quiet()
    print(f"(waited {waited:.0f} s for the machine to go quiet after the 1B run before timing the schedules)")
    schedules = {}
    print(
        "\nOffload schedules, 10.8M-parameter GPT, batch 1 x 8 tokens (optimizer-heavy), median ms per step;"
        " speed-ups: median of 8 rounds' own ratios"
    )
    # 4 staging slots, then the same with double buffering only, to show what the two extra slots buy.
    runs = [("split", 4), ("shared", 4), ("split", 2)] if split_cores() else [("shared", 4), ("shared", 2)]
    for cores, slots in runs:
        # 8 rounds: one round's ratio (4 steps of each) varies by +-15% on this machine; the median of 8 settles.
        r = compare_schedules(
            "10m", seq_len=8, rounds=8, cores=cores, slots=slots, out_dir=out if slots == 4 else None
        )
        key = cores if slots == 4 else f"{cores}, {slots} slots"
        schedules[key] = {k: v for k, v in r.items() if k != "losses"}
        print(f"{f'{cores} cores, {slots} slots':<22}" + "".join(f"{k} {v:>6.0f}   " for k, v in r["median_ms"].items())
              + f"overlapped/serial {r['overlapped_vs_serial']:.2f}x, DPU/overlapped {r['delayed_vs_overlapped']:.2f}x")  # fmt: skip
    print("(target: overlapped >= 1.3x serial with split cores: the device's compute on one core, the CPU Adam "
          "on the other; sharing both cores, the phases compete and the gain is smaller; with 2 staging slots "
          "backward waits whenever the host falls two units behind)")  # fmt: skip
    return {"schedules": schedules, "largest": {**largest, "ratio": ratio}}
