"""Activation recomputation (principles/recompute.py) under ZeRO: the forward run again in backward changes
nothing in the result, at stage 2 and at stage 3."""

from __future__ import annotations

import pytest

from tests.support.distributed import check, run_ranks
from tests.support.training import make_config, max_rel, train_run


def _recompute(rank, world_size, stage):
    config = make_config(stage)
    config["activation_checkpointing"] = {}
    return train_run(rank, world_size, config, steps=3)


@pytest.mark.parametrize("stage", [2, 3])
def test_recomputation_changes_nothing_in_the_result(stage):
    results = check(run_ranks(_recompute, 2, stage))
    reference = train_run(0, 1, make_config(0), steps=3)
    assert max_rel(results[0]["weights"], reference["weights"]) < 1e-6
