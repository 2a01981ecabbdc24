"""Two `make bench` sections about the CPU step, reported and never judged (a timing is no test):

  model_vs_engine()  the performance model's CPU step against the engine's own, measured, after calibrating on
                     this machine; one model has many small tensors, one a few large ones;
  after_torch_op()   the C Adam on a quiet machine and right after a parallel torch op, beside torch's fused Adam.

Both print the machine they ran on (CPU, the kernel variant it dispatched, its caches): a ratio measured on one
CPU says little about another, and whether a model's states fit in the last-level cache changes its speed.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict

import torch
from torch import nn
from tqdm import tqdm

from ...accelerator import EmulatedAccelerator
from ...engine import initialize
from ...tuning.build import CPUAdamUnavailable
from ...tuning.cpu_adam import CPUAdam, dispatched_variant, supported_variants
from ...tuning.cpuinfo import cpu_caches, cpu_model
from ...tuning.perfmodel import Workload, cached_share, calibrate, plan
from ...tuning.state_precision import PRECISIONS
from ...tuning.variant_choice import cached_choices, choice_key, fastest_variant

# (width, depth): `depth` Linear layers of `width`, each one unit and one C call of the CPU step.
MODEL_CASES = {"4.2M params in 16 tensors": (512, 16), "16.8M params in 4 tensors": (2048, 4)}
TOLERANCE = 0.25  # the claim: the prediction within 25% of the measured step


def machine() -> dict:
    """The CPU, the variant our kernel dispatches on it (None without a C compiler) and its caches."""
    caches = cpu_caches()
    fastest = {}
    try:
        variant = dispatched_variant()
        # What "variant": "fastest" (the engine's default) runs here, at 1 and 2 threads and for each precision
        # of the moments, with the timings it chose from (tuning/variant_choice.py; measured once per machine,
        # then read from the cache).
        for precision in PRECISIONS:
            for threads in (1, 2):
                chosen = fastest_variant(threads, supported_variants(), precision)
                fastest[f"{precision}, {threads}"] = {
                    "precision": precision,
                    "threads": threads,
                    "variant": chosen,
                    "ms": cached_choices().get(choice_key(threads, precision), {}).get("ms"),
                }
    except CPUAdamUnavailable:
        variant = None
    return {
        "cpu": cpu_model(),
        "kernel_variant": variant,
        "fastest_variant": fastest,
        "caches": asdict(caches),
        "caches_text": caches.describe(),
    }


def _print_machine(about: dict) -> None:
    print(
        f"CPU: {about['cpu']}; C Adam variant: {about['kernel_variant'] or 'none (no C compiler)'} (the widest); "
        f"caches: {about['caches_text']}"
    )
    for entry in about.get("fastest_variant", {}).values():
        timings = ", ".join(f"{v} {ms:.2f} ms" for v, ms in (entry["ms"] or {}).items())
        print(
            f"  fastest with {entry['precision']} moments at {entry['threads']} thread(s), the engine's default: "
            f"{entry['variant']} ({timings})"
        )


def _print_waited(result: dict) -> None:
    if "waited_for_quiet_s" in result:  # run_bench waits at most 90 s for the other processes to finish
        print(f"(waited {result['waited_for_quiet_s']:.0f} s for the machine to go quiet)")


def _offload_engine(width: int, depth: int):
    """ZeRO-2 with the optimizer offloaded, fp32, one rank, the C Adam on one thread; and a function that runs
    `count` training steps and returns the median of their CPU steps (`adam_seconds`)."""
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    config = {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "zero_offload": {"cpu_adam": {"impl": "simd", "threads": 1}},
    }
    engine = initialize(model, config, accelerator=EmulatedAccelerator())
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(0))

    def steps(count: int) -> float:
        for _ in range(count):
            engine.backward(engine(x).pow(2).mean())
            engine.step()
        return statistics.median(record["adam_seconds"] for record in engine.history[-count:])

    steps(1)  # the first step pays for first touches of its buffers
    return engine, steps


def model_vs_engine(rounds: int = 7) -> dict:
    """Measured against predicted CPU step for each of MODEL_CASES, one C thread and one torch thread (on two
    cores more threads fight over them: torch's OpenMP workers spin for a while after each parallel op).

    Noise on a shared machine comes in bursts, so each round calibrates and then times every engine at once;
    the ratio reported is the median of the rounds' own ratios."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engines = {name: _offload_engine(*shape) for name, shape in MODEL_CASES.items()}
        runs = {name: [] for name in engines}  # (measured, predicted) seconds, one pair a round
        for _ in tqdm(range(rounds), desc="model vs engine", unit="round"):
            hw = calibrate(threads=1, precision="fp32")
            for name, (engine, steps) in engines.items():
                wl = Workload(engine.num_params, precision="fp32", units=len(engine.states.units))
                runs[name].append((steps(3), plan(hw, wl, 2, "optimizer").time.cpu_adam))
    finally:
        torch.set_num_threads(previous)
    cases = {}
    for name, pairs in runs.items():
        engine = engines[name][0]
        ratio = statistics.median(measured / predicted for measured, predicted in pairs)
        cases[name] = {
            "params": engine.num_params,
            "tensors": len(engine.states.units),
            "state_bytes": 16 * engine.num_params,  # fp32 master, gradient, m, v on the host
            "cached_share": cached_share(hw, 16 * engine.num_params),  # the last round's calibration
            "measured_ms": 1e3 * statistics.median(m for m, _ in pairs),
            "predicted_ms": 1e3 * statistics.median(p for _, p in pairs),
            "measured_over_predicted": ratio,
            "within_tolerance": abs(ratio - 1) <= TOLERANCE,
            "rounds_ms": [(1e3 * m, 1e3 * p) for m, p in pairs],
        }
    return {"machine": machine(), "calibration": hw.notes, "rounds": rounds, "cases": cases}


def print_model_vs_engine(result: dict) -> None:
    print(
        f"\nPerformance model against the engine's CPU step (fp32, ZeRO-2 + optimizer offload, 1 C thread, "
        f"{result['rounds']} rounds: each calibrates, then times both models; medians)"
    )
    _print_waited(result)
    _print_machine(result["machine"])
    print(f"last calibration: {result['calibration']}")
    print(
        f"{'workload':<28}{'states':>9}{'cached':>8}{'measured ms':>13}{'predicted ms':>14}"
        f"{'measured/predicted':>20}  within +-{TOLERANCE:.0%}"
    )
    for name, case in result["cases"].items():
        print(
            f"{name:<28}{case['state_bytes'] / 2**20:>5.0f} MiB{case['cached_share']:>8.0%}"
            f"{case['measured_ms']:>13.2f}{case['predicted_ms']:>14.2f}{case['measured_over_predicted']:>20.2f}"
            f"  {'yes' if case['within_tolerance'] else 'no'}"
        )


def _spin_ms(torch_op, wait: float = 0.05, repeats: int = 5) -> float:
    """CPU time the process burns in the `wait` seconds after `torch_op`, while its own thread sleeps: torch's
    OpenMP workers spinning before they go to sleep (libgomp spins a while; GOMP_SPINCOUNT, OMP_WAIT_POLICY)."""
    burnt = []
    for _ in range(repeats):
        torch_op()
        start = time.process_time()
        time.sleep(wait)
        burnt.append(time.process_time() - start)
    return 1e3 * statistics.median(burnt)


def after_torch_op(numel: int = 16_700_000, rounds: int = 7, threads: int = 2) -> dict:
    """One Adam step over `numel` fp32 parameters: our C Adam (the variant it dispatches, `threads` threads of
    its own) and torch's fused Adam (torch's `threads` OpenMP threads), each timed on a quiet machine (torch's
    workers had 0.1 s to stop spinning) and right after a parallel torch op (while they may still spin).

    Torch's next op runs on the spinning workers and loses nothing; our kernel starts its own threads, which
    share the cores with them: on `threads` cores the two pools together are more threads than cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        scratch = torch.ones(1 << 20)  # 4 MiB: large enough for torch to split it over its threads

        def make(fused: bool):
            param = torch.zeros(numel, requires_grad=True)
            param.grad = grad
            if fused:
                return torch.optim.Adam([param], lr=1e-3, fused=True).step
            return CPUAdam([param], lr=1e-3, adamw=False, threads=threads).step

        steps = {"torch fused": make(True)}
        try:
            steps = {f"ours {dispatched_variant()} x{threads}": make(False), **steps}
        except CPUAdamUnavailable:
            pass
        conditions = {"quiet": lambda: time.sleep(0.1), "after a torch op": lambda: scratch.mul_(1.0)}
        times = {(impl, cond): [] for impl in steps for cond in conditions}
        for step in steps.values():
            step()  # first touches of the moments
        # Each step right after the other implementation's and the other condition's: a slow spell of a shared
        # machine then falls on all four alike, and the ratios below compare neighbours.
        for _ in tqdm(range(3 * rounds), desc="after a torch op", unit="round"):
            for impl, step in steps.items():
                for cond, before in conditions.items():
                    before()
                    start = time.perf_counter()
                    step()
                    times[impl, cond].append(time.perf_counter() - start)
        spin = _spin_ms(lambda: scratch.mul_(1.0))
    finally:
        torch.set_num_threads(previous)
    ms = {impl: {cond: 1e3 * statistics.median(times[impl, cond]) for cond in conditions} for impl in steps}
    ours = next((impl for impl in steps if impl.startswith("ours")), None)
    vs_fused = (
        {  # torch fused's time over ours, step by step: above 1, ours is faster
            cond: statistics.median(
                f / o for f, o in zip(times["torch fused", cond], times[ours, cond], strict=True)
            )
            for cond in conditions
        }
        if ours
        else {}
    )
    return {
        "numel": numel,
        "threads": threads,
        "rounds": rounds,
        "median_ms": ms,
        "ours_vs_fused": vs_fused,
        "spin_ms": spin,
        "machine": machine(),
    }


def print_after_torch_op(result: dict) -> None:
    ms, conditions = result["median_ms"], ("quiet", "after a torch op")
    print(
        f"\nAdam step over {result['numel']:,} fp32 parameters, {result['threads']} threads, on a quiet machine "
        f"and right after a parallel torch op (medians of {3 * result['rounds']} interleaved steps each)"
    )
    _print_waited(result)
    _print_machine(result["machine"])
    print(f"{'implementation':<28}{'quiet ms':>10}{'after a torch op ms':>21}")
    for impl, by in ms.items():
        print(f"{impl:<28}{by['quiet']:>10.2f}{by['after a torch op']:>21.2f}")
    if result["ours_vs_fused"]:
        speed = [result["ours_vs_fused"][c] for c in conditions]
        print(
            f"{'ours vs torch fused':<28}{speed[0]:>9.2f}x{speed[1]:>20.2f}x   (median of step-by-step ratios)"
        )
    print(
        f"(torch's OpenMP workers burnt {result['spin_ms']:.1f} ms of CPU in the 50 ms after a torch op while "
        "the process slept: they spin before they sleep)"
    )
