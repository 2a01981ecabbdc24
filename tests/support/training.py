"""Training runs shared by the ZeRO and offload tests: one config shape, one loop, one comparison.

Every run trains the nano GPT on the fixed corpus with the global batch split in rank order, so a run on N ranks
can be compared with one process on the whole batch.
"""

from __future__ import annotations

import torch

import zero_offload as zo
from tests.support.corpus import fixed_corpus
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss

STEPS, BATCH, SEQ = 20, 6, 32  # a batch of 6 splits over 1, 2 and 3 ranks
# lr 1e-3: measured on this model, one step differs from one process by 6e-8 (summation order); with lr 3e-3
# training is chaotic enough to grow that to 3e-6 in 20 steps, with 1e-3 it stays below 5e-7.


def make_config(stage, precision="fp32", **zero):
    config = {
        "train_batch_size": BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000, **zero},
    }
    if precision != "fp32":
        # A modest loss scale: a rank's gradient (over fewer samples) can overflow fp16 where the whole batch's
        # does not; a skip on one side only would compare two different trajectories.
        config[precision] = {"enabled": True, "initial_scale_power": 10}
    return config


def train_run(rank, world_size, config, steps=STEPS, accumulation=1):
    """Train the tiny GPT; return the full final weights, the norms, the traffic and the memory books."""
    data = ByteBatches(fixed_corpus(), SEQ, seed=11)
    model = TinyGPT("nano", seed=0)
    engine = zo.initialize(model, config, accelerator=EmulatedAccelerator())
    micro = BATCH // (world_size * accumulation)
    losses = []
    for step in range(steps):
        for k in range(accumulation):
            x, y = data.micro_batch(
                step, micro, micro_step=k, rank=rank, world_size=world_size, accumulation=accumulation
            )
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        if step == 0:
            traffic = dict(engine.comm.elements)
            transfers = engine.states.transfers  # PCIe bytes: None unless offloaded
            pcie = dict(transfers.bytes) if transfers is not None else {}
    if engine.config.zero_optimization.stage == 3:
        for index in range(len(engine.states.units)):
            engine.states.gathering.gather(index)
    report = engine.memory_report()
    return {
        "weights": {n: p.detach().float().clone() for n, p in model.named_parameters()},
        "norms": [r["grad_norm"] for r in engine.history],
        "traffic": traffic,
        "pcie": pcie,
        "losses": losses,
        "skipped": engine.skipped_steps,
        "measured": report.measured.bytes,
        "estimated": report.estimated.bytes,
        "padding": getattr(engine.states, "padding", None),
        "units": [(u.numel, u.padded_numel) for u in getattr(engine.states, "units", [])],
    }


def max_rel(a: dict, b: dict) -> float:
    """The largest relative error of any weight tensor, as a norm: ||a - b|| / ||b||."""
    return max(float(torch.linalg.vector_norm(a[k] - b[k]) / torch.linalg.vector_norm(b[k])) for k in b)


def train_delayed(model, optimizer, steps: int, start: int) -> list[float]:
    """Plain torch as the delayed update (DPU) trains: the gradient of step t is taken on the weights the
    engine shows at step t, which up to step `start` are the current ones and after it one update old.
    Trains `model` with `optimizer` in place on the whole batch; returns the losses."""
    params = list(model.parameters())
    data = ByteBatches(fixed_corpus(), SEQ, seed=11)
    visible = [p.detach().clone() for p in params]
    losses = []
    for step in range(steps):
        current = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, v in zip(params, visible, strict=True):
                p.copy_(v)
        x, y = data.micro_batch(step, BATCH, micro_step=0, rank=0, world_size=1, accumulation=1)
        loss = lm_loss(model(x), y)
        model.zero_grad()
        loss.backward()
        losses.append(float(loss.detach()))
        with torch.no_grad():
            for p, c in zip(params, current, strict=True):
                p.copy_(c)
        optimizer.step()
        visible = [p.detach().clone() for p in params] if step + 1 <= start else current
    return losses
