"""ZeRO stage 3 (principles/stage3_*.py): parameters gathered unit by unit, prefetched as far as the config
says, and never more than one unit of full weights held while the engine is set up."""

from __future__ import annotations

import math

import torch

import zero_offload as zo
from tests.support.distributed import check, run_ranks
from tests.support.training import make_config, max_rel, train_run
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.workloads import TinyGPT


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
