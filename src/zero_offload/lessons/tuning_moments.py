"""Lesson 4, section 8: Adam's moments in bf16 and 8 bits -- the codes, a v that cannot decay, and training.

`train_with_moments` is also the loop of tools/measure_moment_convergence.py, whose committed output the
lesson shows beside its own short runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import initialize
from ..accelerator import EmulatedAccelerator
from ..tuning.state_precision import BLOCK, decode_moments, dequantize_blocks, encode_moments, quantize_blocks
from ..workloads import ByteBatches, TinyGPT, gpt_config, lm_loss

LAST = 20  # training steps averaged for the "last steps" loss


def moment_config(precision: str, *, fp16: bool = False, batch: int = 16) -> dict:
    """Stage 2 with the optimizer offloaded, the C Adam on one thread, its moments stored in `precision`."""
    config = {
        "train_batch_size": batch,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.999], "weight_decay": 0.01}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "zero_offload": {"cpu_adam": {"impl": "simd", "threads": 1, "states": precision}},
    }
    if fp16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 100}
    return config


def train_with_moments(
    model: torch.nn.Module,
    config: dict,
    train: ByteBatches,
    held_out: ByteBatches,
    loss_of: Callable,
    steps: int,
    *,
    val_batches: int = 8,
    param_groups=None,
) -> dict:
    """Train `steps` steps on one process; every step's loss, the held-out loss at the end (the same
    `val_batches` batches for every run), the skipped steps and the host's optimizer bytes a parameter."""
    engine = initialize(model, config, accelerator=EmulatedAccelerator(), param_groups=param_groups)
    accumulation = engine.gradient_accumulation_steps
    micro = engine.config.train_micro_batch_size_per_gpu
    losses = []
    for step in range(steps):
        total = 0.0
        for k in range(accumulation):
            x, y = train.micro_batch(step, micro, micro_step=k, accumulation=accumulation)
            loss = loss_of(engine, x, y)
            engine.backward(loss)
            engine.step()  # updates at the last micro-batch only
            total += loss.item() / accumulation
        losses.append(total)
    with torch.no_grad():
        val = [loss_of(engine, *held_out.global_batch(i, micro)).item() for i in range(val_batches)]
    result = {
        "num_params": engine.num_params,
        "steps": steps,
        "val_loss": sum(val) / len(val),
        "last_loss": sum(losses[-LAST:]) / len(losses[-LAST:]),
        "losses": losses,
        "skipped_steps": engine.skipped_steps,
        "host_optimizer_bytes_per_param": engine.memory_report().optimizer_bytes_per_param()["host"],
    }
    engine.close()
    return result


def tinygpt_loss(engine, x, y):
    return lm_loss(engine(x), y)


def train_tinygpt(precision: str, *, seed: int, steps: int, corpus, fp16: bool = False) -> dict:
    """TinyGPT "tiny" under moment_config(precision): initial weights and data order from `seed`."""
    cfg = gpt_config("tiny")
    train = ByteBatches(corpus, cfg.seq_len, seed=seed)
    held_out = ByteBatches(corpus, cfg.seq_len, split="val")  # the same held-out batches for every seed
    config = moment_config(precision, fp16=fp16)
    return train_with_moments(TinyGPT(cfg, seed=seed), config, train, held_out, tinygpt_loss, steps)


def round_trip_errors(x: torch.Tensor) -> dict[str, float]:
    """The largest |x - decode(encode(x))| with one scale per block of BLOCK values and with one scale for the
    whole tensor (what a block buys when one block holds much larger values than the rest)."""
    codes, scales = quantize_blocks(x, signed=True)
    per_block = dequantize_blocks(codes, scales, signed=True)
    top = x.abs().max()
    per_tensor = torch.round(x * (127 / top)) * (top / 127)
    small = slice(BLOCK, None)  # everything but the first block, which holds the large values
    return {
        "per block, small blocks": (x[small] - per_block[small]).abs().max().item(),
        "per tensor, small blocks": (x[small] - per_tensor[small]).abs().max().item(),
        "small values' size": x[small].abs().max().item(),
    }


def decay_without_gradients(v0: float, steps: int, beta2: float = 0.999) -> dict[str, list[float]]:
    """One block of v, stored between steps in each precision as the host keeps it. Element 0 gets a gradient
    with g^2 = v0 every step, so it stays v0 (the block's largest, which sets an int8 block's scale); element 1
    starts at v0 / 4 and gets no gradient, so Adam's v <- beta2 v + (1 - beta2) g^2 should decay it by beta2 a
    step. Returns element 1 after each step, per precision."""
    g2 = torch.zeros(BLOCK)
    g2[0] = v0
    out = {}
    for precision in ("fp32", "bf16", "int8"):
        m, v = torch.zeros(BLOCK), torch.full((BLOCK,), v0 / 4)
        v[0] = v0
        history = []
        for _ in range(steps):
            m, v = decode_moments(encode_moments(m, beta2 * v + (1 - beta2) * g2, precision))
            history.append(v[1].item())
        out[precision] = history
    return out
