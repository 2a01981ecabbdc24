"""Distribution checks for `make gpu-check`: the installed torch's collectives, one GPU per rank, and two ranks
training together (NCCL on CUDA, gloo on the emulated device)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zero_offload.accelerator import CudaAccelerator
from zero_offload.principles.process_group import free_port
from zero_offload.workloads import TinyGPT

from .configs import TOLERANCE, relative_error, snapshot
from .runs import PINNED, Setup, child_command, child_pythonpath, first_difference, make_config, say, train

# The single-tensor collectives the engine uses: torch 2.13's names, then those of torch 2.1 to 2.12.
COLLECTIVES = {
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
    "all_gather": ("all_gather_single", "all_gather_into_tensor"),
}
RANKS, RANK_STEPS = 2, 3


def check_torch_api(setup: Setup) -> dict:
    """The installed torch.distributed has each collective the engine needs, under one of its names."""
    found = {kind: [n for n in names if hasattr(dist, n)] for kind, names in COLLECTIVES.items()}
    for kind, names in found.items():
        which = (
            "MISSING" if not names else "newest name" if names[0] == COLLECTIVES[kind][0] else "older name"
        )
        say(f"  {kind}: {', '.join(names) or 'none'} ({which})")
    problems = [f"torch {torch.__version__} has none of torch.distributed.{' / '.join(COLLECTIVES[k])}"
                for k, names in found.items() if not names]  # fmt: skip
    return {"torch": torch.__version__, "found": found, "problems": problems}


def check_one_gpu_per_rank(setup: Setup) -> dict:
    """A rank whose LOCAL_RANK has no GPU of its own (two ranks on a one-GPU machine: LOCAL_RANK=1) is refused by
    the accelerator with the engine's message, rather than sharing cuda:0 until NCCL fails."""
    count = torch.cuda.device_count()  # 0 on the emulated device: LOCAL_RANK=0 is then the rank without a GPU
    before = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(count)
    try:
        CudaAccelerator()
        message = None
    except (RuntimeError, ValueError) as err:
        message = str(err)
    finally:
        if before is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = before
    refused = message is not None and f"LOCAL_RANK={count}" in message
    say(
        f"  LOCAL_RANK={count} on {count} GPU(s): {'refused: ' + message[:160] if refused else 'NOT refused'}"
    )
    problems = (
        [] if refused else [f"LOCAL_RANK={count} on a machine with {count} GPU(s) was not refused: {message}"]
    )
    return {"gpus": count, "local_rank": count, "message": message, "problems": problems}


def two_ranks_config(setup: Setup, zero: dict) -> dict:
    return make_config(setup, zero, precision="fp32")  # fp32: the two ranks must match one process closely


def ranks_child(setup: Setup, out: Path) -> int:
    """One of check_two_ranks' processes: its share of the batches, stage 2 + offload, its weights to `out`."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = two_ranks_config(setup, {"stage": 2, "offload_optimizer": PINNED})
    run = train(setup, config, steps=RANK_STEPS, model=TinyGPT(setup.model), rank=rank, world_size=world)
    torch.save(run["weights"], out)
    return 0


def _launch(setup: Setup, scratch: Path, timeout: float) -> list[str]:
    """Start the ranks, wait for them; what went wrong, if anything."""
    port, env = str(free_port()), dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(RANKS),
               ZO_DEVICE="cpu" if setup.emulated else "cuda",
               PYTHONPATH=child_pythonpath())  # fmt: skip
    procs = []
    for rank in range(RANKS):
        cmd = child_command("--ranks-child", str(scratch / f"rank{rank}.pt"))
        cmd += ["--emulated"] if setup.emulated else []
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(
            subprocess.Popen(cmd, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    problems, until = [], time.monotonic() + timeout
    for rank, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=max(1.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            problems.append(f"rank {rank} did not finish within {timeout:.0f} s")
            continue
        if proc.returncode != 0:
            tail = [line for line in output.splitlines() if line.strip()][-1:] or ["no output"]
            problems.append(f"rank {rank} exited with {proc.returncode}: {tail[0][:300]}")
    return problems


def check_two_ranks(setup: Setup) -> dict:
    """Two processes train stage 2 + offload together (NCCL, one GPU each; gloo on the emulated device): both end
    with the same weights, and those of one process training the whole batch at stage 0, within fp32's tolerance."""
    backend = "gloo" if setup.emulated else "nccl"
    if not setup.emulated and torch.cuda.device_count() < RANKS:
        reason = f"skipped: needs {RANKS} GPUs, this machine has {torch.cuda.device_count()}"
        say(f"  {reason}")
        return {"status": "skipped", "reason": reason}
    scratch = setup.scratch / "ranks"
    scratch.mkdir(exist_ok=True)
    problems = _launch(setup, scratch, max(30.0, min(60.0, setup.deadline - time.monotonic())))
    if problems:
        say(f"  {backend}, {RANKS} ranks: FAILED: {problems[0]}")
        return {"backend": backend, "problems": problems}
    model = TinyGPT(setup.model)
    initial = snapshot(model)
    reference = train(setup, two_ranks_config(setup, {"stage": 0}), steps=RANK_STEPS, model=model)["weights"]
    ranks = [torch.load(scratch / f"rank{r}.pt", weights_only=True) for r in range(RANKS)]
    # The masters are each rank's own shard: only what forward reads must agree.
    ranks = [{n: w[n] for n in initial} for w in ranks]
    differs = first_difference(ranks[0], ranks[1])
    error, tol = relative_error(ranks[0], reference, initial), TOLERANCE["fp32"]
    if differs is not None:
        problems.append(f"the ranks' weights differ, first at {differs}")
    if not error <= tol:
        problems.append(
            f"weights {error:.3g} of the one-process run's movement away from it (tolerance {tol})"
        )
    say(
        f"  {backend}, {RANKS} ranks, stage 2 + offload: ranks {'equal' if differs is None else 'DIFFER'}; "
        f"error against one process at stage 0 {error:.2e} (tolerance {tol})"
    )
    return {"backend": backend, "ranks_equal": differs is None, "relative_error": round(error, 6),
            "tolerance": tol, "problems": problems}  # fmt: skip
