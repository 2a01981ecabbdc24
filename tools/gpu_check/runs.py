"""Training runs for `make gpu-check`: configs, one timed loop, and check 2 (overlapped equals serial, bit for bit).

Every run builds its engine with the accelerator the script chose (a real CUDA device, or the emulated one under
--emulated), so a run on the GPU machine never falls back to the emulated device whatever ZO_DEVICE says.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

import zero_offload as zo
from zero_offload.accelerator import Accelerator
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss, load_corpus

PINNED = {"device": "cpu", "pin_memory": True}
# The repository root. A check that needs a fresh process runs this package again as a child, with the root
# (for the package tools.gpu_check) and src/ (a bare checkout on the GPU machine has no installed
# zero_offload) on the child's PYTHONPATH.
ROOT = Path(__file__).resolve().parents[2]


def child_command(*args: str) -> list[str]:
    """The command line that runs this package again, in a child process, with these arguments."""
    return [sys.executable, "-m", "tools.gpu_check", *args]


def child_pythonpath() -> str:
    """PYTHONPATH for a child: the repository root and src/ first, then whatever the parent had."""
    parts = (str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", ""))
    return os.pathsep.join(p for p in parts if p)


@dataclass
class Setup:
    """What every check needs: the device, the model sizes for this mode, and a scratch directory."""

    accel: Accelerator
    emulated: bool
    model: str  # checks 1-3 and 5: small enough to be quick
    big_model: str  # checks 7 and 8: large enough that the host's Adam matters
    batch: int
    big_steps: int
    scratch: Path
    sub_group_size: int  # NVMe tier: cuts the small model into several sub-groups
    deadline: float = math.inf  # time.monotonic() by which the whole run should be done


def say(text: str) -> None:
    print(text, flush=True)


def make_config(setup: Setup, zero: dict, *, precision: str = "fp16", ext: dict | None = None, **top) -> dict:
    config = {"train_batch_size": setup.batch, "zero_optimization": zero, "zero_offload": ext or {}, **top}
    if precision != "fp32":
        # 2**12 rather than 2**16: the first steps of a fresh model would otherwise be skipped as overflows.
        config[precision] = {"enabled": True, **({"initial_scale_power": 12} if precision == "fp16" else {})}
    return config


def overlap(**more) -> dict:
    return {"overlap_offload": True, **more}


def dpu(start_step: int = 1) -> dict:
    return overlap(delayed_param_update={"enabled": True, "start_step": start_step})


def sync(setup: Setup) -> None:
    """Wait for the device's queued work, so that a host clock read after it times the device's work too."""
    if not setup.emulated:
        torch.cuda.synchronize()


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def train(setup: Setup, config: dict, *, steps: int = 4, model=None, size: str | None = None,
          rank: int = 0, world_size: int = 1) -> dict:  # fmt: skip
    """`steps` steps; losses, per-step times (synchronized wall time) and the final weights.

    `model` may be a Hugging Face causal LM (called with input_ids and labels); the default is TinyGPT(size).
    Rank `rank` of `world_size` trains on its share of each global batch, in rank order.
    """
    model = model if model is not None else TinyGPT(size or setup.model)
    hf = not isinstance(model, TinyGPT)
    seq_len = model.config.n_positions if hf else model.cfg.seq_len
    data = ByteBatches(load_corpus(), seq_len, seed=3)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*use_cache.*")  # said by transformers under recompute
        engine = zo.initialize(model, config, accelerator=setup.accel)
        try:
            losses, compute, total = [], [], []
            for step in range(steps):
                micro = config["train_batch_size"] // world_size
                x, y = data.micro_batch(step, micro, rank=rank, world_size=world_size)
                sync(setup)
                started = time.perf_counter()
                if hf:
                    loss = engine(input_ids=x, labels=x).loss
                else:
                    loss = lm_loss(engine(x), y)
                engine.backward(loss)
                sync(setup)
                backward_done = time.perf_counter()
                engine.step()
                sync(setup)
                total.append(time.perf_counter() - started)
                compute.append(backward_done - started)
                losses.append(loss.item())
            engine.synchronize()
            # state_dict, not the parameters: under stage 3 a parameter holds only this rank's shard.
            weights = {n: t.detach().float().cpu().clone() for n, t in model.state_dict().items()}
            for i, master in enumerate(getattr(engine.states, "master_params", [])):
                weights[f"master.{i}"] = master.detach().float().cpu().clone()
            master = getattr(engine.states, "master", None)
            return {
                "losses": losses,
                "ms_per_step": [round(t * 1000, 3) for t in total],
                "forward_backward_ms": [round(t * 1000, 3) for t in compute],
                "adam_ms": [round(r["adam_seconds"] * 1000, 3) for r in engine.history],
                "skipped_steps": engine.skipped_steps,
                "host_pinned": bool(master.is_pinned()) if isinstance(master, torch.Tensor) else None,
                "weights": weights,
            }
        finally:
            engine.close()


def first_difference(a: dict, b: dict) -> str | None:
    """The name of the first tensor that differs between two weight snapshots, or None if all are equal."""
    if a.keys() != b.keys():
        return f"different tensors: {sorted(a.keys() ^ b.keys())[:3]}"
    return next((name for name in a if not torch.equal(a[name], b[name])), None)


@contextlib.contextmanager
def deterministic(setup: Setup):
    """Deterministic CUDA kernels for the block (CUBLAS_WORKSPACE_CONFIG was set before CUDA started); yields
    what it did, for the results. The emulated device's kernels need nothing."""
    if setup.emulated:
        yield "skipped: needs CUDA"
        return
    before, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    try:
        yield "on"
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def hf_model():
    try:
        import transformers
    except ImportError as err:
        return None, f"transformers cannot be imported ({err})"
    transformers.logging.set_verbosity_error()  # its notes on a config this small are not findings
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=256, n_positions=64,
                                     bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config), None


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def largest_unit(model: torch.nn.Module) -> int:
    """Elements of the largest module that owns parameters: the engine's unit (principles/partition.py)."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def check_overlap_equal(setup: Setup) -> dict:
    """Check 2: the overlapped pipeline ends with the serial step's weights, bit for bit. Buckets of one unit,
    reduced as they fill: the copies to the host then run while backward still computes the other units, the
    ordering most likely to go wrong (the default 500M-element bucket holds the whole model, and nothing overlaps)."""
    bucket = largest_unit(TinyGPT(setup.model))
    zero = {"stage": 2, "offload_optimizer": PINNED, "overlap_comm": True, "reduce_bucket_size": bucket}
    with deterministic(setup) as mode:
        serial = train(setup, make_config(setup, zero), steps=6)
        overlapped = train(setup, make_config(setup, zero, ext=overlap()), steps=6)
    differs = first_difference(serial["weights"], overlapped["weights"])
    say(f"  serial vs overlapped (fp16, 6 steps, buckets of {bucket} elements): "
        f"{'equal' if differs is None else 'DIFFER at ' + differs}")  # fmt: skip
    return {
        "deterministic_kernels": mode,
        "reduce_bucket_size": bucket,
        "equal": differs is None,
        "first_difference": differs,
        "serial_losses": serial["losses"],
        "overlapped_losses": overlapped["losses"],
        "problems": [] if differs is None else [f"weights differ, first at {differs}"],
    }
