"""The timeline (practice/timeline.py): every stage of a step is recorded where and when it ran, per rank."""

from __future__ import annotations

import pytest
import torch
from distributed import check, run_ranks
from training import BATCH, SEQ, make_config

import zero_offload as zo
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.practice.timeline import Timeline
from zero_offload.workloads import TinyGPT, lm_loss


def _engine(stage=2, precision="fp16", **zero):
    return zo.initialize(
        TinyGPT("nano"), make_config(stage, precision, **zero), accelerator=EmulatedAccelerator()
    )


def _steps(engine, steps, rank=0, world_size=1):
    for step in range(steps):
        x = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        x = x[rank * BATCH // world_size : (rank + 1) * BATCH // world_size]
        engine.backward(lm_loss(engine(x), x))
        engine.step()


def _window(spans, stage):
    mine = [s for s in spans if s.stage == stage]
    assert mine, f"no {stage} span"
    return min(s.start for s in mine), max(s.end for s in mine)


def test_an_offloaded_step_records_every_stage_in_order(tmp_path):
    engine = _engine(offload_optimizer={"device": "cpu"}, reduce_bucket_size=20_000)
    _steps(engine, 2)
    [spans] = engine.timeline(tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert all(s.end >= s.start for s in spans)
    last = [s for s in spans if s.step == 1]
    # One rank: the weight shard is the whole buffer, so there is nothing to all-gather.
    # One rank: nothing to reduce, each bucket is already this rank's shard.
    assert {s.stage for s in last} == {"forward", "backward", "D2H", "Adam", "H2D"}
    forward, backward, adam = (_window(last, stage) for stage in ("forward", "backward", "Adam"))
    assert forward[1] <= backward[0] and backward[1] <= adam[0]
    # Gradients leave during backward, bucket by bucket; weights go up after Adam has started.
    d2h, h2d = _window(last, "D2H"), _window(last, "H2D")
    assert backward[0] <= d2h[0] and d2h[1] <= backward[1]
    assert h2d[0] >= adam[0]
    assert sum(s.stage == "D2H" for s in last) == len(engine.states.units)  # one copy a unit's shard


def test_only_the_last_steps_are_kept():
    timeline = Timeline(keep_steps=3)
    for step in range(10):
        timeline.step = step
        with timeline.span("forward"):
            pass
    assert [s.step for s in timeline.spans] == [7, 8, 9]
    with pytest.raises(ValueError, match="unknown stage 'fwd'"):
        timeline.add("fwd", 0.0, 1.0)


def _two_rank_timeline(rank, world_size, path):
    engine = _engine(3, "fp32", overlap_comm=True)  # stage 3: gathers, prefetched asynchronously
    _steps(engine, 2, rank, world_size)
    return engine.timeline(path if rank == 0 else None)


@pytest.mark.slow
def test_every_rank_sees_every_ranks_spans(tmp_path):
    results = check(run_ranks(_two_rank_timeline, 2, str(tmp_path / "two.png")))
    for by_rank in results:
        assert len(by_rank) == 2
        for spans in by_rank:
            stages = {s.stage for s in spans}
            assert {"forward", "backward", "reduce", "Adam", "all-gather"} <= stages
            assert all(s.end >= s.start for s in spans)
    assert (tmp_path / "two.png").exists()
