"""Training runs for `make gpu-check`: configs, one timed loop, and checks 1-3 (configurations, bit equality).

Every run builds its engine with the accelerator the script chose (a real CUDA device, or the emulated one under
--emulated), so a run on the GPU machine never falls back to the emulated device whatever ZO_DEVICE says.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

import zero_offload as zo
from zero_offload.accelerator import Accelerator
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss, load_corpus

PINNED = {"device": "cpu", "pin_memory": True}


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


def train(setup: Setup, config: dict, *, steps: int = 4, model=None, size: str | None = None) -> dict:
    """`steps` steps; losses, per-step times (synchronized wall time) and the final weights.

    `model` may be a Hugging Face causal LM (called with input_ids and labels); the default is TinyGPT(size).
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
                x, y = data.global_batch(step, config["train_batch_size"])
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


def _hf_model():
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


def configurations(setup: Setup) -> dict[str, dict]:
    """Check 1's configurations: name -> engine config."""
    nvme = {"device": "nvme", "nvme_path": str(setup.scratch / "nvme"), "buffer_count": 2}
    return {
        "stage0": make_config(setup, {"stage": 0}),
        "stage2_offload_pinned": make_config(setup, {"stage": 2, "offload_optimizer": PINNED}),
        "stage2_offload_overlap": make_config(
            setup, {"stage": 2, "offload_optimizer": PINNED}, ext=overlap()
        ),
        "stage2_offload_dpu": make_config(setup, {"stage": 2, "offload_optimizer": PINNED}, ext=dpu()),
        "stage3_offload_param": make_config(
            setup, {"stage": 3, "offload_optimizer": PINNED, "offload_param": PINNED}
        ),
        "partial_offload_0.5": make_config(
            setup, {"stage": 2, "offload_optimizer": {**PINNED, "ratio": 0.5}}
        ),
        "nvme_offload": make_config(
            setup, {"stage": 2, "offload_optimizer": nvme, "sub_group_size": setup.sub_group_size}
        ),
        "bf16_recompute": make_config(
            setup, {"stage": 2, "offload_optimizer": PINNED}, precision="bf16", activation_checkpointing={}
        ),
        "hf_gpt2": make_config(setup, {"stage": 2, "offload_optimizer": PINNED}, precision="fp32"),
    }


def check_configurations(setup: Setup) -> dict:
    """Check 1: every configuration runs 4 steps with finite losses; each is tried even if another fails."""
    results, problems = {}, []
    for name, config in configurations(setup).items():
        try:
            model = None
            if name == "hf_gpt2":
                model, why = _hf_model()
                if model is None:
                    results[name] = {"status": "skipped", "reason": why}
                    say(f"  {name:<24} skipped: {why}")
                    continue
            run = train(setup, config, model=model)
            run.pop("weights")
            finite = len(run["losses"]) == 4 and all(math.isfinite(v) for v in run["losses"])
            run["status"] = "passed" if finite else "failed"
            run["median_ms_per_step"] = median(run["ms_per_step"])
            if not finite:
                problems.append(f"{name}: losses {run['losses']}")
            results[name] = run
            losses = " ".join(f"{v:.4f}" for v in run["losses"])
            say(f"  {name:<24} {run['median_ms_per_step']:9.1f} ms/step  losses {losses}")
        except Exception as err:  # one configuration's failure must not hide the others' results
            results[name] = {"status": "failed", "error": one_line(err)}
            problems.append(f"{name}: {one_line(err)}")
            say(f"  {name:<24} FAILED: {one_line(err)}")
    return {"configurations": results, "problems": problems}


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def check_overlap_equal(setup: Setup) -> dict:
    """Check 2: the overlapped pipeline ends with the serial step's weights, bit for bit."""
    zero = {"stage": 2, "offload_optimizer": PINNED}
    with deterministic(setup) as mode:
        serial = train(setup, make_config(setup, zero), steps=6)
        overlapped = train(setup, make_config(setup, zero, ext=overlap()), steps=6)
    differs = first_difference(serial["weights"], overlapped["weights"])
    say(f"  serial vs overlapped (fp16, 6 steps): {'equal' if differs is None else 'DIFFER at ' + differs}")
    return {
        "deterministic_kernels": mode,
        "equal": differs is None,
        "first_difference": differs,
        "serial_losses": serial["losses"],
        "overlapped_losses": overlapped["losses"],
        "problems": [] if differs is None else [f"weights differ, first at {differs}"],
    }


def check_dpu_race(setup: Setup) -> dict:
    """Check 3: the delayed update with pinned host buffers equals the same run with pageable ones, whose
    copies are synchronous and so cannot race with the host's Adam."""
    out, problems = {}, []
    with deterministic(setup) as mode:
        for precision in ("fp32", "fp16"):
            runs = {}
            for pin in (True, False):
                zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": pin}}
                ext = dpu() | {"cpu_adam": {"impl": "simd"}}
                runs[pin] = train(setup, make_config(setup, zero, precision=precision, ext=ext), steps=6)
            differs = first_difference(runs[True]["weights"], runs[False]["weights"])
            out[precision] = {
                "equal": differs is None,
                "first_difference": differs,
                "host_pinned": {"pinned": runs[True]["host_pinned"], "pageable": runs[False]["host_pinned"]},
                "losses": runs[True]["losses"],
            }
            if differs is not None:
                problems.append(f"{precision}: pinned and pageable weights differ, first at {differs}")
            say(
                f"  DPU pinned vs pageable ({precision}): {'equal' if differs is None else 'DIFFER at ' + differs}"
            )
    return {"deterministic_kernels": mode, **out, "problems": problems}
