"""Module 5's decisions, as a table: for each configuration, how far each backward runs ahead of the step.

    eager         Adam runs on each unit as its gradient arrives, before backward returns: only on the last
                  micro-batch, and only if nothing needs the whole gradient first (no fp16 overflow check, no
                  clipping to the global norm, no delayed update this step), and only if the up stream can
                  wait for the host's Adam without blocking backward's thread (not a CUDA stream)
    direct        Adam reads the staging slot itself and the fp32 gradient partition is never written: eager,
                  one micro-batch, and module 4's C Adam (which reads fp16/bf16 gradients)
    kept          the delayed update reads each unit's gradient where it landed, in an area of its own, and the
                  fp32 gradient partition is never written: a delayed step, one micro-batch, no fp16, and an
                  Adam that reads the gradient as it came down (fp32: any; bf16: the C Adam)
    norm in Adam  the C Adam sums each unit's squared norm in its own pass: nothing to clip, no delayed update

Each row is observed, not just read from a flag: the masters changed before step() (eager), the fp32 gradient
partition was never touched (direct, kept), every unit's gradient landed in the step's area (kept), no separate
pass took the norm (norm in Adam).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.modules.test_pipeline import _BlockingCopyStream, _config, _engine
from tests.support.corpus import fixed_corpus
from tests.support.training import BATCH, SEQ
from zero_offload.practice.host_gradients import PartitionState
from zero_offload.workloads import ByteBatches, lm_loss


def expected(precision, clip, accumulation, dpu, impl, waits, *, step, micro):
    last = micro == accumulation - 1
    delayed = dpu and step >= 1  # start_step 1: step 0 is the warm-up
    eager = last and precision != "fp16" and not clip and not delayed and waits
    direct = eager and impl == "simd" and accumulation == 1
    kept = delayed and (impl == "simd" or precision == "fp32") and accumulation == 1 and precision != "fp16"
    return eager, direct, kept, impl == "simd" and not clip and not dpu


ROWS = [
    *itertools.product(
        ["fp32", "bf16", "fp16"], [False, True], [1, 2], [False, True], ["simd", "torch"], [True]
    ),
    ("fp32", False, 1, False, "simd", False),  # CUDA's up stream: Adam waits for the step
    ("bf16", False, 2, False, "simd", False),
]


@pytest.mark.parametrize(("precision", "clip", "accumulation", "dpu", "impl", "waits"), ROWS)
def test_each_backward_runs_as_far_ahead_as_the_rules_allow(precision, clip, accumulation, dpu, impl, waits):
    ext = {"delayed_param_update": {"enabled": True, "start_step": 1}} if dpu else None
    config = _config(2, precision, overlap=True, impl=impl, clip=0.5 if clip else 0.0, ext=ext)
    config["gradient_accumulation_steps"] = accumulation
    engine = _engine(config)
    pipeline = engine.optimizer_step.pipeline
    if not waits:
        pipeline.up = _BlockingCopyStream(pipeline.up)
    data = ByteBatches(fixed_corpus(), SEQ, seed=11)
    touched = False  # whether any backward so far wrote the fp32 gradient partition
    for step in range(2):
        for micro in range(accumulation):
            before = [m.clone() for m in engine.states.master_params]
            x, y = data.micro_batch(step, BATCH // accumulation, micro_step=micro, accumulation=accumulation)
            engine.backward(lm_loss(engine(x), y))
            moved = [not torch.equal(a, b) for a, b in zip(before, engine.states.master_params, strict=True)]
            eager, direct, kept, norm_in_adam = expected(
                precision, clip, accumulation, dpu, impl, waits, step=step, micro=micro
            )
            where = f"step {step}, micro-batch {micro}"
            touched = touched or not (direct or kept)
            assert all(moved) if eager else not any(moved), f"{where}: eager should be {eager}"
            untouched = pipeline.partition.state is PartitionState.UNDEFINED
            assert untouched == (not touched), f"{where}: direct {direct}, kept {kept}"
            assert pipeline.keeping == kept, f"{where}: kept should be {kept}"
            landed = set(range(engine.states.host_units)) if kept else set()
            assert (pipeline.kept.landed if pipeline.kept is not None else set()) == landed, where
            assert engine.optimizer_step.norm_in_adam == pipeline.norm_in_adam == norm_in_adam, where
            assert (pipeline.eager, pipeline.direct and pipeline.eager) == (eager, direct), where
            # Reading the slot directly is only right when the slot holds the whole gradient: one micro-batch.
            assert not pipeline.direct or accumulation == 1, where
            engine.step()
    engine.synchronize()
    assert all(torch.isfinite(m).all() for m in engine.states.master_params)
