"""Device-level checks for `make gpu-check`: the machine, the out-of-memory hint, the CUDA sanitizer, copy
bandwidth, and where an offloaded step spends its time (checks 4-8)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from zero_offload.accelerator import CudaAccelerator, EmulatedAccelerator
from zero_offload.workloads import gpt_config

from .runs import (
    PINNED,
    Setup,
    child_command,
    child_pythonpath,
    dpu,
    make_config,
    median,
    one_line,
    overlap,
    say,
    sync,
    train,
)

NEEDS_CUDA = {"status": "skipped", "reason": "skipped: needs CUDA"}
RACE_MARK = "data race"  # what the CUDA sanitizer's report says


def accelerator(emulated: bool, capacity: int | None = None):
    """Chosen explicitly, never from ZO_DEVICE: the real run must not fall back to the emulated device."""
    return EmulatedAccelerator(capacity) if emulated else CudaAccelerator(capacity)


def release_memory(setup: Setup) -> None:
    """Free what earlier checks left, so that each check starts from an empty device."""
    gc.collect()
    if not setup.emulated:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def environment(emulated: bool) -> dict:
    info = {
        "mode": "emulated" if emulated else "cuda",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
    if emulated:
        info["device"] = "emulated device (CPU)"
    else:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(device=props.name, device_memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}")  # fmt: skip
    try:
        from zero_offload.tuning.cpuinfo import cpu_model

        info["cpu_model"] = cpu_model()
    except Exception as err:
        info["cpu_model"] = f"unknown ({one_line(err)})"
    try:
        import cffi

        info["cffi"] = cffi.__version__
    except ImportError as err:
        info["cffi"] = f"missing ({err})"
    try:
        from zero_offload.tuning.cpu_adam import dispatched_variant, supported_variants

        info["c_kernel"] = {
            "available": True,
            "variant": dispatched_variant(),
            "variants": supported_variants(),
        }
    except Exception as err:  # no cffi or no compiler: the engine falls back to torch's Adam
        info["c_kernel"] = {"available": False, "error": one_line(err)}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def check_oom(setup: Setup) -> dict:
    """Check 4: a too-small budget raises torch's OOM with the offload hint; a later accelerator made without a
    budget is not held to the old cap."""
    cap = 256 * 2**10 if setup.emulated else 32 * 2**20
    release_memory(setup)
    text = None
    try:
        train(
            replace(setup, accel=accelerator(setup.emulated, cap)), make_config(setup, {"stage": 0}), steps=1
        )
    except torch.OutOfMemoryError as err:
        text = str(err)
    finally:
        unbounded = accelerator(setup.emulated)  # lifts the per-process cap, even after another error
    release_memory(setup)
    block = unbounded.empty(2 * cap, torch.uint8, category="other").fill_(1)
    sync(setup)
    allocated = block.numel()
    del block
    problems = []
    if text is None:
        problems.append(f"no OutOfMemoryError under a {cap} byte budget")
    elif "Hint:" not in text:
        problems.append(f"the OutOfMemoryError has no 'Hint:': {text.splitlines()[0][:200]}")
    hint = (text or "")[(text or "").find("Hint:") :].splitlines()[0] if "Hint:" in (text or "") else ""
    say(f"  OOM under {cap / 2**20:.2f} MiB: {'raised' if text else 'NOT raised'}; {hint.strip()[:160]}")
    say(f"  after the budget: allocated {allocated / 2**20:.2f} MiB without a cap")
    return {"budget_bytes": cap, "raised": text is not None, "hint": hint.strip(),
            "allocated_after_bytes": allocated, "problems": problems}  # fmt: skip


def sanitizer_child() -> int:
    """Run under TORCH_CUDA_SANITIZER=1 by check 5: three overlapped steps on a small model."""
    setup = Setup(accelerator(False), False, "tiny", "tiny", 4, 3, Path("."), 1)
    run = train(setup, make_config(setup, {"stage": 2, "offload_optimizer": PINNED}, ext=overlap()), steps=3)
    say(f"sanitized overlapped run: losses {run['losses']}")
    return 0


def check_sanitizer(setup: Setup) -> dict:
    """Check 5: the overlapped pipeline under torch's CUDA sanitizer, in a fresh process (the variable must be
    set before torch is imported)."""
    if setup.emulated:
        return dict(NEEDS_CUDA)
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1", PYTHONPATH=child_pythonpath())
    cmd = child_command("--sanitizer-child")
    timeout = max(30.0, min(120.0, setup.deadline - time.monotonic()))  # its share of the budget
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        code, output = proc.returncode, (proc.stdout + proc.stderr).splitlines()
    except subprocess.TimeoutExpired as err:  # its output so far says how far it got
        code = None
        output = b"".join(o for o in (err.stdout, err.stderr) if o).decode(errors="replace").splitlines()
    race = any(RACE_MARK in line for line in output)
    say(f"  sanitizer: exit code {code}, data race reported: {race}")
    for line in output[-3:]:
        say(f"    {line[:200]}")
    problems = ["the sanitizer reported a data race"] if race else []
    if code != 0:
        problems.append(
            f"the sanitized run timed out after {timeout:.0f} s"
            if code is None
            else f"the sanitized run exited with {code}"
        )
    return {"exit_code": code, "race_reported": race, "output_tail": output[-40:], "problems": problems}


def _gbs(dst: torch.Tensor, src: torch.Tensor, repeats: int = 8) -> float:
    dst.copy_(src, non_blocking=True)  # warm-up: the first copy of a pageable buffer also faults its pages in
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return round(src.numel() * repeats / (start.elapsed_time(end) / 1000) / 1e9, 2)


def check_bandwidth(setup: Setup) -> dict:
    """Check 6: pinned and pageable copies, each direction, in GB/s (CUDA-event timed)."""
    if setup.emulated:
        return dict(NEEDS_CUDA)
    release_memory(setup)
    nbytes = 256 * 2**20
    device = torch.empty(nbytes, dtype=torch.uint8, device=setup.accel.device)
    out = {"bytes": nbytes}
    for kind, host in (("pinned", torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)),
                       ("pageable", torch.ones(nbytes, dtype=torch.uint8))):  # fmt: skip
        out[kind] = {"h2d_gbs": _gbs(device, host), "d2h_gbs": _gbs(host, device)}
        say(f"  {kind:>8}: H2D {out[kind]['h2d_gbs']:7.2f} GB/s, D2H {out[kind]['d2h_gbs']:7.2f} GB/s")
    return out


def _tail(values: list[float]) -> float:
    """Median of the second half: the first steps pay for warm-up (allocator, kernel selection)."""
    return median(values[len(values) // 2 :])


def check_adam_vs_gpu(setup: Setup) -> dict:
    """Check 7: the host's Adam time against the device's forward and backward, for stage 2 + offload."""
    release_memory(setup)
    steps, size = setup.big_steps, setup.big_model
    offloaded = train(
        setup, make_config(setup, {"stage": 2, "offload_optimizer": PINNED}), steps=steps, size=size
    )
    on_device = train(setup, make_config(setup, {"stage": 0}), steps=steps, size=size)
    out = {
        "model": size,
        "num_params": gpt_config(size).num_params(),
        "offload_step_ms": _tail(offloaded["ms_per_step"]),
        "offload_forward_backward_ms": _tail(offloaded["forward_backward_ms"]),
        "cpu_adam_ms": _tail(offloaded["adam_ms"]),
        "device_only_step_ms": _tail(on_device["ms_per_step"]),
        "device_only_forward_backward_ms": _tail(on_device["forward_backward_ms"]),
    }
    out["cpu_adam_over_device_step"] = round(out["cpu_adam_ms"] / out["device_only_step_ms"], 3)
    say(f"  {size} ({out['num_params'] / 1e6:.1f}M params), stage 2 + offload: step {out['offload_step_ms']:.1f} "
        f"ms, of which CPU Adam {out['cpu_adam_ms']:.1f} ms; forward+backward {out['offload_forward_backward_ms']:.1f}"
        f" ms; all on the device: step {out['device_only_step_ms']:.1f} ms")  # fmt: skip
    return out


def check_serial_vs_overlap(setup: Setup) -> dict:
    """Check 8: the serial, overlapped and delayed offloaded step times on the larger model."""
    release_memory(setup)
    zero, out = {"stage": 2, "offload_optimizer": PINNED}, {"model": setup.big_model}
    for name, ext in (("serial", None), ("overlapped", overlap()), ("delayed", dpu())):
        run = train(setup, make_config(setup, zero, ext=ext), steps=setup.big_steps, size=setup.big_model)
        out[f"{name}_ms"] = _tail(run["ms_per_step"])
        say(
            f"  {name:<11} {out[f'{name}_ms']:9.1f} ms/step (median of the last {setup.big_steps - setup.big_steps // 2})"
        )
    out["overlapped_over_serial"] = round(out["overlapped_ms"] / out["serial_ms"], 3)
    return out
