"""The largest model that trains under a device budget, with and without offload (the paper's headline).

The ZeRO-Offload paper trains 13B parameters on one 32 GB V100, against 1.4B for plain PyTorch: about 10x.
Here the device is the emulated one with a budget (512 MB by default) and the host is this machine:

  without offload  stage 0 in bf16 keeps 16 bytes a parameter on the device (weights, gradients, fp32 master,
                   m, v) plus activations; the largest width that survives one step is found by bisection.
  with offload     stage 3 with offload_param and offload_optimizer keeps about one layer's weights on the
                   device at a time; what limits the model is host memory. Adam's moments are kept in 8 bits
                   on the host (module 4's "states": "int8"), so a parameter's optimizer states take about 6
                   bytes instead of 12. The preset "1b" (1.0B parameters) is trained for a few steps to show
                   that it really trains.
  host capacity    the host bytes a parameter with fp32 and with int8 moments, measured on a small model, and
                   how many parameters this host's free memory holds with each.
"""

from __future__ import annotations

import gc
import time

import torch

from ...accelerator import DeviceOutOfMemoryError, EmulatedAccelerator
from ...basics.memory import estimate_model_states
from ...engine import initialize
from ...tuning.build import CPUAdamUnavailable, build
from ...units import format_bytes
from ...workloads import ByteBatches, GPTConfig, TinyGPT, gpt_config, lm_loss, load_corpus

BATCH, SEQ = 1, 32  # a short sequence: activations stay small, the model states are what is measured


# The moments of the offloaded runs: 8-bit codes with a scale per block (module 4), the fewest host bytes.
MOMENTS = "int8"


def offload_moments() -> str:
    """int8 where the C Adam builds (only it runs narrow moments), else fp32: the demo still runs without a
    compiler, and says which it used."""
    try:
        build()
    except CPUAdamUnavailable:
        return "fp32"
    return MOMENTS


def _config(cfg: GPTConfig, offload: bool, budget: int, moments: str = MOMENTS) -> dict:
    zero = {"stage": 0}
    if offload:
        block = 12 * cfg.d_model**2 + 13 * cfg.d_model  # one transformer block's parameters
        zero = {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
            # About one block gathered ahead and one bucket of gradients: the device holds a layer or two.
            "stage3_prefetch_bucket_size": block,
            "reduce_bucket_size": block,
        }
    return {
        "train_batch_size": BATCH,
        "bf16": {"enabled": True},
        # A small rate: Adam's first steps move every weight by about lr, which a large model with random weights
        # overshoots at rates that suit a small one. No clipping, so that with the overlapped pipeline each unit's
        # Adam reads its gradient straight from the staging slot and the fp32 gradient buffer is never touched.
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "zero_offload": {
            "device_memory": budget,
            "overlap_offload": offload,
            **({"cpu_adam": {"states": moments}} if offload else {}),
        },
    }


def train_steps(cfg: GPTConfig, *, offload: bool, budget: int, steps: int, moments: str = MOMENTS) -> dict:
    """Train `steps` steps under `budget`; the losses and peak device bytes, or {"oom": message}."""
    data = ByteBatches(load_corpus(), SEQ, seed=0)
    model = engine = None
    try:
        start = time.perf_counter()
        model = TinyGPT(cfg, seed=0, dtype=torch.bfloat16)
        engine = initialize(
            model, _config(cfg, offload, budget, moments), accelerator=EmulatedAccelerator(budget)
        )
        losses = []
        # One batch, seen every step: with 32 tokens a batch, the loss of different batches varies more than
        # a few steps of learning move it; on the same batch a falling loss shows the update works.
        x, y = data.global_batch(0, BATCH)
        for _ in range(steps):
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        stats = engine.accelerator.memory_stats()
        report = engine.memory_report()
        return {
            "params": engine.num_params,
            "losses": losses,
            "device_peak": stats.peak,
            "host_bytes": report.measured.host + report.host_staging,
            "optimizer_bytes_per_param": report.optimizer_bytes_per_param()["host"],
            "seconds": time.perf_counter() - start,
        }
    except DeviceOutOfMemoryError as err:
        return {"params": cfg.num_params(), "oom": str(err).splitlines()[0]}
    finally:
        del model, engine
        gc.collect()


def largest_without_offload(budget: int, *, n_layer: int = 8, steps: int = 1) -> dict:
    """Bisect the width (a multiple of 64) of an `n_layer`-block GPT for the largest that trains under `budget`."""
    low, high = 1, 2  # widths in units of 64: 64 always fits a budget worth searching
    while train_steps(_shape(high * 64, n_layer), offload=False, budget=budget, steps=steps).get("losses"):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        fits = "losses" in train_steps(_shape(mid * 64, n_layer), offload=False, budget=budget, steps=steps)
        low, high = (mid, high) if fits else (low, mid)
    result = train_steps(_shape(low * 64, n_layer), offload=False, budget=budget, steps=steps)
    result["d_model"], result["n_layer"] = low * 64, n_layer
    result["next_oom"] = train_steps(_shape(high * 64, n_layer), offload=False, budget=budget, steps=1).get(
        "oom"
    )
    return result


def _shape(d_model: int, n_layer: int) -> GPTConfig:
    return GPTConfig(seq_len=SEQ, d_model=d_model, n_layer=n_layer, n_head=max(1, d_model // 64))


def host_memory_available() -> int:
    """Bytes the kernel says a new allocation can still get (MemAvailable), or 0 where that is unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def host_bytes_needed(model: str, moments: str = MOMENTS) -> int:
    """Host memory to train preset `model` with stage 3 + offload on one rank: the states, and the bf16 model
    the engine copies them from, and a twentieth more: with fp32 moments the 1B run peaked at 18.6 GiB here
    against 19.0 GiB of these (its fp32 gradient buffer is never touched: Adam reads each gradient from the
    staging slot)."""
    params = gpt_config(model).num_params()
    states = estimate_model_states(params, stage=3, world_size=1, offload_optimizer="cpu", offload_param="cpu",
                                   precision="bf16", moments=moments)  # fmt: skip
    return int((states.host + 2 * params) * 1.05)


def largest_preset_for_this_host(moments: str = MOMENTS) -> str:
    """'1b' when this host has the memory for it right now, else '100m'."""
    return "1b" if host_memory_available() >= host_bytes_needed("1b", moments) else "100m"


def offloaded_run(model: str = "1b", *, budget: int, steps: int = 3, moments: str = MOMENTS) -> dict:
    """Train preset `model` with stage 3 + parameter and optimizer offload, after checking the host can hold it."""
    cfg = gpt_config(model, seq_len=SEQ)
    need, available = host_bytes_needed(model, moments), host_memory_available()
    if available and need > available:
        raise MemoryError(
            f"training {model!r} ({cfg.num_params() / 1e9:.2f}B parameters) with offload needs about "
            f"{format_bytes(need)} of host memory and {format_bytes(available)} is available; close other "
            "programs, or pick a smaller preset (e.g. '100m')"
        )
    result = train_steps(cfg, offload=True, budget=budget, steps=steps, moments=moments)
    if "oom" in result:
        raise RuntimeError(
            f"{model!r} does not train under {format_bytes(budget)} even with offload: {result['oom']}"
        )
    result["model"], result["moments"] = model, moments
    return result


def host_capacity(budget: int, model: str = "small", available: int | None = None) -> dict:
    """Host bytes a parameter with fp32 and with int8 moments, measured by one step of preset `model` under
    stage 3 + offload, and the parameters `available` bytes of host memory (default: free now) hold with each
    (None where unknown)."""
    available = host_memory_available() if available is None else available
    result = {"model": model, "available": available}
    for moments in ("fp32", "int8"):
        run = train_steps(
            gpt_config(model, seq_len=SEQ), offload=True, budget=budget, steps=1, moments=moments
        )
        per_param = run["host_bytes"] / run["params"]
        result[moments] = {
            "host_bytes_per_param": per_param,
            "optimizer_bytes_per_param": run["optimizer_bytes_per_param"],
            "params_this_host_holds": int(available / per_param) if available else None,
        }
    result["more_params"] = result["fp32"]["host_bytes_per_param"] / result["int8"]["host_bytes_per_param"]
    return result


def measure(budget: int, *, quick: bool = False) -> dict:
    """Both sides of the comparison, the largest preset this host's memory allows right now (or 'nano'/'small'
    in quick mode), and what the int8 moments buy on this host."""
    # Free host memory before anything here has run: memory a process frees is not all given back.
    available = host_memory_available()
    plain, moments = largest_without_offload(budget), offload_moments()
    model = "small" if quick else largest_preset_for_this_host(moments)
    offloaded = offloaded_run(model, budget=budget, steps=3, moments=moments)
    result = {"without": plain, "with": offloaded}
    if moments == MOMENTS:
        result["host_capacity"] = host_capacity(
            budget, model="nano" if quick else "small", available=available
        )
    return result


def measure_in_fresh_process(budget: int, *, quick: bool = False) -> dict:
    """`measure` in a new Python process: the caller's freed memory is not all given back to the system, and
    the 1B run needs nearly all of this machine's."""
    import json
    import subprocess
    import sys

    code = f"import json; from zero_offload.cli.bench.largest import measure; print(json.dumps(measure({budget}, quick={quick})))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"the largest-model measurement failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])
