"""Parity with DeepSpeed: the same JSON config, the same model and batches, the same losses.

Runs only where `deepspeed` is installed (skipped otherwise), on the CPU: DS_ACCELERATOR=cpu and a gloo group
on loopback, 1 and 2 ranks. Each rank trains the nano GPT for 20 steps twice in one process, once through
`deepspeed.initialize` and once through `zo.initialize`, with the same config dict (ZeRO stage 2, optimizer
offloaded to the CPU, fp32, AdamW, gradient clipping) and the same slice of each global batch, in rank order.

DeepSpeed's offloaded optimizer is DeepSpeedCPUAdam, a C++ op that DeepSpeed compiles on first use with g++
and ninja (about 5 minutes on two cores, then cached under TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by
default): the fixture below builds it once in the parent, before any rank starts its clock.

eps is large (1e-3) so that a gradient of the wrong scale changes Adam's update instead of hiding behind its
normalisation, and the clipping threshold lies inside the range of this run's gradient norms (1.8 to 3.1), so
that some steps are clipped and some are not: with every step clipped, a gradient of the wrong scale would be
clipped back to the same update. The global gradient norms are compared too, step by step.

To run it, in a separate environment (DeepSpeed is not one of the project's dependencies):

    python3.11 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0 && /tmp/dsvenv/bin/pip install -e . pytest==9.2.0
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install deepspeed==0.19.8
    /tmp/dsvenv/bin/python -m pytest -q tests/engine/test_deepspeed_parity.py
"""

from __future__ import annotations

import os

import pytest

# DeepSpeed picks its accelerator when it is imported; this test is for its CPU one.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")

import torch  # noqa: E402

import zero_offload as zo  # noqa: E402
from tests.support.corpus import fixed_corpus  # noqa: E402
from tests.support.distributed import check, run_ranks  # noqa: E402
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss  # noqa: E402

STEPS, BATCH, MODEL, SEED = 20, 4, "nano", 11
LOSS_REL = 1e-5  # the bound; measured: 4e-7 (summation order, DeepSpeedCPUAdam's SIMD arithmetic)
WEIGHT_REL = 1e-5  # ||ours - theirs|| / ||theirs|| per tensor after 20 steps; measured: 1.5e-6


def ds_config(world_size: int) -> dict:
    """One config for both engines: a plain DeepSpeed config, which zero_offload reads unchanged."""
    return {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": BATCH // world_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 2.0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-3, "weight_decay": 0.01},
        },
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu"},
            "reduce_bucket_size": 20_000,
            "allgather_bucket_size": 20_000,
        },
        "steps_per_print": 1_000,
    }


def _train(rank: int, world_size: int, engine, model, grad_norm) -> dict:
    data = ByteBatches(fixed_corpus(), model.cfg.seq_len, seed=SEED)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = data.micro_batch(step, BATCH // world_size, rank=rank, world_size=world_size)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().item())
        norms.append(float(grad_norm(engine)))
    weights = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights}


def _both_engines(rank: int, world_size: int) -> dict:
    # What a launcher would set; deepspeed.initialize insists on LOCAL_RANK and reuses the gloo group
    # that run_ranks has already started.
    os.environ.update(
        DS_ACCELERATOR="cpu",
        ZO_DEVICE="cpu",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
    )
    import deepspeed

    config = ds_config(world_size)
    model = TinyGPT(MODEL, seed=0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=dict(config))
    theirs = _train(rank, world_size, engine, model, lambda e: e.get_global_grad_norm())
    del engine

    model = TinyGPT(MODEL, seed=0)
    engine = zo.initialize(model, dict(config))
    ours = _train(rank, world_size, engine, model, lambda e: e.history[-1]["grad_norm"])
    return {"deepspeed": theirs, "zero_offload": ours}


@pytest.fixture(scope="module", autouse=True)
def cpu_ops_built():
    """Compile (or load from the cache) DeepSpeed's CPU ops once, here, not in every rank at once."""
    from deepspeed.accelerator import get_accelerator

    assert get_accelerator().device_name() == "cpu", "set DS_ACCELERATOR=cpu before deepspeed is imported"
    for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible():
            builder.load(verbose=False)


def _rel(ours: float, theirs: float) -> float:
    return abs(ours - theirs) / abs(theirs)


def _mean_over_ranks(results: list, side: str, key: str) -> list[float]:
    return [sum(r[side][key][step] for r in results) / len(results) for step in range(STEPS)]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_stage2_cpu_offload_trains_like_deepspeed(world_size):
    results = check(run_ranks(_both_engines, world_size, timeout_s=300))
    theirs = _mean_over_ranks(results, "deepspeed", "losses")
    ours = _mean_over_ranks(results, "zero_offload", "losses")
    loss_diffs = [_rel(a, b) for a, b in zip(ours, theirs, strict=True)]
    assert max(loss_diffs) < LOSS_REL, {"max": max(loss_diffs), "ours": ours, "deepspeed": theirs}

    # Global norms (before clipping) catch a gradient of the wrong scale directly; they are the same on every rank.
    for result in results:
        for step, (a, b) in enumerate(
            zip(result["zero_offload"]["norms"], result["deepspeed"]["norms"], strict=True)
        ):
            assert _rel(a, b) < LOSS_REL, (step, a, b)
    clipped = [norm > ds_config(world_size)["gradient_clipping"] for norm in results[0]["deepspeed"]["norms"]]
    assert any(clipped) and not all(clipped), "the run must take clipped and unclipped steps"

    for result in results:
        ours_w, theirs_w = result["zero_offload"]["weights"], result["deepspeed"]["weights"]
        assert ours_w.keys() == theirs_w.keys()
        for name, reference in theirs_w.items():
            err = float(
                torch.linalg.vector_norm(ours_w[name] - reference) / torch.linalg.vector_norm(reference)
            )
            assert err < WEIGHT_REL, (name, err)
