"""ZeRO stages 1-3 on a real gloo group: the same training as one process, the memory and traffic of the theory.

Every test spawns 2 or 3 ranks on loopback (3 gives uneven shards) and compares with single-process stage 0
on the same global batch, split in rank order. eps is large (1e-3) so that a wrong gradient scale cannot hide
behind Adam's normalisation, and the global gradient norms are compared step by step.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from distributed import check, run_ranks
from training import BATCH, SEQ, make_config, max_rel, train_run

import zero_offload as zo
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.config import ConfigError
from zero_offload.principles.comm import CommunicationError
from zero_offload.workloads import TinyGPT, lm_loss


def _all_stages(rank, world_size, precision):
    return {stage: train_run(rank, world_size, make_config(stage, precision)) for stage in (1, 2, 3)}


@pytest.fixture(scope="module")
def single():
    return {p: train_run(0, 1, make_config(0, p)) for p in ("fp32", "fp16")}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_fp32_training_equals_one_process(single, world_size):
    results = check(run_ranks(_all_stages, world_size, "fp32"))
    for stage in (1, 2, 3):
        for rank, result in enumerate(results):
            got = result[stage]
            assert max_rel(got["weights"], single["fp32"]["weights"]) < 1e-6, (stage, rank)
            # Norms catch a wrong scale (sum instead of mean) that Adam's update would hide.
            for ours, reference in zip(got["norms"], single["fp32"]["norms"], strict=True):
                assert ours == pytest.approx(reference, rel=1e-5), (stage, rank)


@pytest.mark.slow
def test_sharded_fp16_training_stays_within_fp16_rounding(single):
    results = check(run_ranks(_all_stages, 2, "fp16"))
    fp16_error = max_rel(single["fp16"]["weights"], single["fp32"]["weights"])  # the fp16 run's own tolerance
    assert None not in single["fp16"]["norms"], "no step may be skipped: the runs must take the same path"
    for stage in (1, 2, 3):
        assert None not in results[0][stage]["norms"], stage
        assert max_rel(results[0][stage]["weights"], single["fp16"]["weights"]) <= fp16_error, stage


def _bytes_per(state, precision="fp32"):
    return {"parameters": 4, "gradients": 4, "master_weights": 4, "exp_avg": 4, "exp_avg_sq": 4}[state]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_ledger_equals_the_estimate_plus_the_reported_padding(world_size):
    results = check(run_ranks(_all_stages, world_size, "fp32"))
    for stage in (1, 2, 3):
        result = results[0][stage]
        full, shard = result["padding"]["full"], result["padding"]["shard"]
        for state in ("parameters", "gradients", "exp_avg", "exp_avg_sq"):
            sharded = {"parameters": stage >= 3, "gradients": stage >= 2}.get(state, True)
            pad = 4 * (shard if sharded else full)
            assert result["measured"][state]["device"] == result["estimated"][state]["device"] + pad, (
                stage,
                state,
            )


@pytest.mark.slow
def test_traffic_per_step_is_2_psi_for_stages_1_2_and_3_psi_for_stage_3():
    results = check(run_ranks(_all_stages, 2, "fp32"))
    for stage in (1, 2, 3):
        result = results[0][stage]
        psi = sum(padded for _, padded in result["units"])  # parameters, padded to whole shards
        traffic = result["traffic"]
        if stage < 3:
            assert traffic["reduce_scatter"] == psi and traffic["all_gather"] == psi
        else:
            # The tied embedding is used twice in forward (wte, then lm_head) and gathered twice.
            tied = result["units"][0][1]
            assert traffic["reduce_scatter"] == psi and traffic["all_gather"] == 2 * psi + tied
        assert traffic.get("control", 0) <= 2  # the overflow flag and the squared norm, one element each


def _accumulate(rank, world_size):
    config = make_config(2, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=BATCH // world_size)
    config.pop("train_batch_size")
    config["zero_optimization"] = {"stage": 2, "reduce_bucket_size": 20_000}
    config["train_micro_batch_size_per_gpu"] = 1
    config["gradient_accumulation_steps"] = BATCH // world_size
    return train_run(rank, world_size, config, steps=5, accumulation=BATCH // world_size)


@pytest.mark.slow
def test_gradient_accumulation_equals_a_larger_batch(single):
    results = check(run_ranks(_accumulate, 2))
    reference = train_run(0, 1, make_config(0), steps=5)
    assert max_rel(results[0]["weights"], reference["weights"]) < 1e-6


def _overflow_on_rank_one(rank, world_size):
    config = make_config(2, "fp16")
    config["fp16"].update(initial_scale_power=8, hysteresis=1)
    engine = zo.initialize(TinyGPT("nano"), config, accelerator=EmulatedAccelerator())
    x = torch.randint(0, 256, (BATCH // world_size, SEQ), generator=torch.Generator().manual_seed(rank))
    engine.backward(lm_loss(engine(x), x))
    engine.step()
    before = [t.clone() for t in (engine.states.master, engine.states.exp_avg, engine.states.exp_avg_sq)]
    loss = lm_loss(engine(x), x)
    if rank == 1:
        loss = loss * float("inf")
    engine.backward(loss)
    engine.step()
    after = (engine.states.master, engine.states.exp_avg, engine.states.exp_avg_sq)
    return {
        "unchanged": all(torch.equal(a, b) for a, b in zip(after, before, strict=True)),
        "scale": engine.scaler.scale,
        "skipped": engine.skipped_steps,
    }


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    for result in check(run_ranks(_overflow_on_rank_one, 2)):
        assert result == {"unchanged": True, "scale": 128.0, "skipped": 1}


def _initialize_with(rank, world_size, configs):
    try:
        zo.initialize(TinyGPT("nano"), configs[rank], accelerator=EmulatedAccelerator())
    except (ValueError, ConfigError) as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


def test_a_global_batch_the_world_size_cannot_divide_is_a_config_error():
    config = {"train_batch_size": 7, "zero_optimization": {"stage": 2}}
    for result in check(run_ranks(_initialize_with, 2, [config, config])):
        assert result["error"] == "ConfigError" and "7" in result["message"] and "2" in result["message"]


def test_configs_that_differ_between_ranks_are_detected():
    configs = [make_config(2), make_config(2, **{"overlap_comm": True})]
    for result in check(run_ranks(_initialize_with, 2, configs)):
        assert result["error"] == "ValueError" and "different configs" in result["message"]


def _die_mid_step(rank, world_size):
    engine = zo.initialize(TinyGPT("nano"), make_config(2), accelerator=EmulatedAccelerator())
    x = torch.randint(0, 256, (BATCH // world_size, SEQ))
    engine.backward(lm_loss(engine(x), x))
    if rank == 1:
        os._exit(3)  # a crashed rank: no exception, no goodbye
    try:
        engine.step()
    except CommunicationError as err:
        return {"error": str(err)}
    return {"error": None}


def test_a_rank_that_dies_mid_step_stops_the_others_with_a_clear_error():
    survivor, dead = run_ranks(_die_mid_step, 2, timeout_s=10)
    assert dead == {"__exitcode__": 3}
    assert survivor["error"] and "rank 0" in survivor["error"], survivor


def test_shard_math_is_consistent_with_one_process():
    reference = train_run(0, 1, make_config(0), steps=2)
    sharded = train_run(0, 1, make_config(3), steps=2)
    assert max_rel(sharded["weights"], reference["weights"]) == 0
    assert not math.isnan(sharded["norms"][0])


def _stage3_prefetch(rank, world_size):
    return {
        size: train_run(rank, world_size, make_config(3, stage3_prefetch_bucket_size=size), steps=4)
        for size in (1, 3_000, 10**9)
    }


def test_stage3_prefetch_changes_traffic_timing_not_results():
    result = check(run_ranks(_stage3_prefetch, 2))[0]
    none, some, everything = result[1], result[3_000], result[10**9]
    for run in (some, everything):
        assert all(torch.equal(run["weights"][k], none["weights"][k]) for k in none["weights"])
        assert run["traffic"] == none["traffic"], "prefetching moves the same bytes, only earlier"


def _recompute(rank, world_size, stage):
    config = make_config(stage)
    config["activation_checkpointing"] = {}
    return train_run(rank, world_size, config, steps=3)


@pytest.mark.parametrize("stage", [2, 3])
def test_recomputation_changes_nothing_in_the_result(stage):
    results = check(run_ranks(_recompute, 2, stage))
    reference = train_run(0, 1, make_config(0), steps=3)
    assert max_rel(results[0]["weights"], reference["weights"]) < 1e-6


def test_stage3_setup_never_holds_more_than_one_unit_of_full_weights():
    accel = EmulatedAccelerator()
    engine = zo.initialize(TinyGPT("nano"), make_config(3), accelerator=accel)
    largest_unit = 4 * max(unit.padded_numel for unit in engine.states.units)
    assert accel.memory_stats().peak <= accel.memory_stats().in_use + largest_unit


def test_stage3_prefetches_as_far_as_deepspeeds_stage3_key_says():
    """DeepSpeed's stage-3 prefetch key is stage3_prefetch_bucket_size (default 5e7); allgather_bucket_size
    is its stages 1-2 bucket, which changes nothing here: a config that sets it is told so."""
    import warnings

    from zero_offload.config import load_config

    assert load_config(make_config(3)).zero_optimization.stage3_prefetch_bucket_size == 50_000_000
    engine = _stage3_engine(stage3_prefetch_bucket_size=3_000)
    assert engine.states.gathering.prefetch_numel == 3_000
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = _stage3_engine(allgather_bucket_size=3_000)
    assert engine.states.gathering.prefetch_numel == 50_000_000
    message = " ".join(str(w.message) for w in caught)
    assert (
        "zero_optimization.allgather_bucket_size (stage 3 prefetches stage3_prefetch_bucket_size)" in message
    )


def _stage3_engine(**zero):
    import zero_offload as zo
    from zero_offload.accelerator import EmulatedAccelerator
    from zero_offload.workloads import TinyGPT

    return zo.initialize(TinyGPT("nano", seed=0), make_config(3, **zero), accelerator=EmulatedAccelerator())
