"""Lab 2 (principles 原理篇): graded tests. `make lab2` grades your files, `make lab2 LAB_DIR=solutions` the reference.

Tasks 2.2-2.4 run on real gloo process groups of 2 or 3 ranks on loopback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.support.distributed import check, run_ranks

from zero_offload.principles.comm import Comm
from zero_offload.principles.partition import ALIGN, shard_layout

pytestmark = pytest.mark.lab2


# ---------------------------------------------------------------------------------------------------- Lab 2.1
def _owners(numels, world_size, align):
    """Brute force: for every element of the flat buffer, (rank, position in shard) -> (param, index)."""
    total = sum(numels)
    shard = -(-total // (world_size * align)) * align
    table = {}
    flat = 0
    for p, n in enumerate(numels):
        for i in range(n):
            table[(flat // shard, flat % shard)] = (p, i)
            flat += 1
    return shard, table


@pytest.mark.task("2.1")
@pytest.mark.parametrize("numels, world_size, align", [
    ([10, 7, 5], 3, 1), ([10, 7, 5], 3, 8), ([64, 64], 2, 8), ([1], 4, 8), ([100, 3, 250, 17], 3, 8),
    ([33], 1, 8), ([8, 8, 8, 8], 4, 1),
])
def test_every_element_is_owned_exactly_once(numels, world_size, align):
    shard, owners = _owners(numels, world_size, align)
    seen = {}
    for rank in range(world_size):
        layout = shard_layout(numels, world_size, rank, align)
        assert layout.shard_numel == shard and layout.padded_numel == shard * world_size
        assert (layout.start, layout.end) == (rank * shard, (rank + 1) * shard)
        for piece in layout.slices:
            for k in range(piece.numel):
                seen[(rank, piece.shard_start + k)] = (piece.param, piece.param_start + k)
    assert seen == owners


@pytest.mark.task("2.1")
def test_a_shard_can_cut_through_a_parameter():
    rank0, rank1 = (shard_layout([12], 2, r, align=1) for r in (0, 1))
    assert [(s.param, s.param_start, s.shard_start, s.numel) for s in rank0.slices] == [(0, 0, 0, 6)]
    assert [(s.param, s.param_start, s.shard_start, s.numel) for s in rank1.slices] == [(0, 6, 0, 6)]


@pytest.mark.task("2.1")
def test_padding_only_at_the_end_and_shards_aligned():
    layout = shard_layout([5, 6], 3, 2)
    assert layout.shard_numel % ALIGN == 0 and layout.slices == ()  # rank 2 holds only padding


# ---------------------------------------------------------------------------------------------------- Lab 2.2
def _reduce_scatter(rank, world_size):
    from zero_offload.principles.zero import reduce_scatter_unit

    comm = Comm()
    shard = 4
    full = torch.arange(world_size * shard, dtype=torch.float32) * (rank + 1)
    out = torch.empty(shard)
    work = reduce_scatter_unit(comm, full.clone(), out, async_op=True)
    if work is not None:
        work.wait()
    sync_out = torch.empty(shard, dtype=torch.float16)
    reduce_scatter_unit(comm, full.half(), sync_out)
    return {"async": out, "sync": sync_out.float(), "elements": dict(comm.elements)}


@pytest.mark.task("2.2")
def test_each_rank_receives_the_average_of_its_chunk():
    world_size = 3
    results = check(run_ranks(_reduce_scatter, world_size))
    mean_factor = sum(r + 1 for r in range(world_size)) / world_size
    for rank, result in enumerate(results):
        want = torch.arange(rank * 4, rank * 4 + 4, dtype=torch.float32) * mean_factor
        torch.testing.assert_close(result["async"], want)
        torch.testing.assert_close(result["sync"], want, rtol=1e-3, atol=1e-3)
        assert result["elements"]["reduce_scatter"] == 2 * world_size * 4, "one reduce-scatter of the full buffer each"


@pytest.mark.task("2.2")
def test_one_rank_keeps_its_gradient():
    from zero_offload.principles.zero import reduce_scatter_unit

    full, out = torch.arange(8.0), torch.empty(8)
    assert reduce_scatter_unit(Comm(), full.clone(), out) is None
    torch.testing.assert_close(out, torch.arange(8.0))


# ---------------------------------------------------------------------------------------------------- Lab 2.3
def _stage12_training(rank, world_size):
    _use_reference_helpers(keep_publish=True)
    return {(stage, precision): _train(rank, world_size, precision, stage)
            for stage in (1, 2) for precision in ("fp32", "fp16")}


@pytest.fixture(scope="module")
def stage12_two_ranks():
    return check(run_ranks(_stage12_training, 2))


@pytest.mark.task("2.3")
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_stage12_training_equals_one_process(stage12_two_ranks, stage, precision):
    reference = _train(0, 1, precision, stage=0)
    tolerance = 1e-6 if precision == "fp32" else 2e-3
    for result in stage12_two_ranks:
        _assert_same_weights(result[(stage, precision)]["weights"], reference["weights"], tolerance)
        assert result[(stage, precision)]["traffic"]["all_gather"] == result[(stage, precision)]["traffic"][
            "reduce_scatter"], "one all-gather of the weights per reduce-scatter of the gradients"


@pytest.mark.task("2.3")
def test_stage3_publishes_the_shard_and_gathers_nothing(monkeypatch):
    _use_reference_helpers(keep_publish=True, patch=monkeypatch.setattr)
    result = _train(0, 1, "fp16", stage=3)
    reference = _train(0, 1, "fp16", stage=0)
    _assert_same_weights(result["weights"], reference["weights"], 1e-7)


# ---------------------------------------------------------------------------------------------------- Lab 2.4
def _use_reference_helpers(keep_publish: bool = False, patch=setattr):
    """Grade one task on its own: correct versions of the others' code stand in for the learner's.

    Rank processes patch for good (they exit after the test); in the test process pass monkeypatch.setattr.
    """
    from zero_offload.principles import partition, zero
    from zero_offload.principles.partition import ShardLayout, Slice

    def layout(numels, world_size, rank, align=ALIGN):
        shard = -(-sum(numels) // (world_size * align)) * align
        lo, pieces, offset = rank * shard, [], 0
        for index, numel in enumerate(numels):
            first, last = max(offset, lo), min(offset + numel, lo + shard)
            if first < last:
                pieces.append(Slice(index, first - offset, first - lo, last - first))
            offset += numel
        return ShardLayout(shard * world_size, shard, lo, lo + shard, tuple(pieces))

    def reduce_scatter(comm, full_grad, shard_out, *, async_op=False):
        return comm.reduce_scatter(shard_out, full_grad.div_(comm.world_size), async_op=async_op)

    def gather(self, index, *, async_op):
        self.accel.restore_storage(self.full_params[index], "parameters")
        self.units[index].gathered = True
        return self.comm.all_gather(self.full_params[index], self.param_shards[index], async_op=async_op)

    def publish(self, *, rounded=False):
        for index in range(len(self.units)):
            if self.master is not None:
                self.param_shards[index].copy_(self.master_params[index])
            if self.stage < 3:
                self.comm.all_gather(self.full_params[index], self.param_shards[index])

    patch(partition, "shard_layout", layout)
    patch(zero, "reduce_scatter_unit", reduce_scatter)
    if keep_publish:
        patch(zero.ShardedStates, "_start_gather", gather)
    else:
        patch(zero.ShardedStates, "publish", publish)


def _train(rank, world_size, precision, stage=3):
    import zero_offload as zo
    from zero_offload.accelerator import EmulatedAccelerator
    from tests.support.corpus import fixed_corpus

    from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss

    config = {"train_batch_size": 4, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-3}}}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    accel = EmulatedAccelerator()
    model = TinyGPT("nano")
    engine = zo.initialize(model, config, accelerator=accel)
    data = ByteBatches(fixed_corpus(), 16, seed=2)
    model_states = accel.memory_stats().in_use
    for step in range(3):
        x, y = data.micro_batch(step, 4 // world_size, rank=rank, world_size=world_size)
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    released = accel.memory_stats().in_use == model_states
    gathered_after = [getattr(u, "gathered", False) for u in getattr(engine.states, "units", [])]
    traffic = dict(engine.comm.elements)
    if stage == 3:
        for index in range(len(engine.states.units)):
            engine.states.gathering.gather(index)
    return {"weights": {n: p.detach().float().clone() for n, p in model.named_parameters()},
            "released": released, "gathered_after": gathered_after, "traffic": traffic}


def _both_precisions(rank, world_size):
    _use_reference_helpers()
    return {precision: _train(rank, world_size, precision) for precision in ("fp32", "fp16")}


@pytest.fixture(scope="module")
def stage3_two_ranks():
    """One launch of two ranks serves every 2.4 test: starting processes is the slow part."""
    return check(run_ranks(_both_precisions, 2))


def _assert_same_weights(got, want, tolerance):
    for name, weight in want.items():
        error = torch.linalg.vector_norm(got[name] - weight) / torch.linalg.vector_norm(weight)
        assert error < tolerance, f"{name}: relative error {float(error):.2e}"


@pytest.mark.task("2.4")
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_stage3_training_equals_one_process(stage3_two_ranks, precision):
    reference = _train(0, 1, precision, stage=0)
    tolerance = 1e-6 if precision == "fp32" else 2e-3  # fp16: a rounding here and there, one ulp apart
    for result in stage3_two_ranks:
        _assert_same_weights(result[precision]["weights"], reference["weights"], tolerance)


@pytest.mark.task("2.4")
def test_stage3_on_one_process_equals_stage0(monkeypatch):
    # One rank: the all-gather is a local copy into the restored buffer.
    _use_reference_helpers(patch=monkeypatch.setattr)
    _assert_same_weights(_train(0, 1, "fp32")["weights"], _train(0, 1, "fp32", 0)["weights"], 1e-7)


@pytest.mark.task("2.4")
def test_stage3_releases_every_layer_after_use_and_gathers_once_per_pass(stage3_two_ranks):
    result = stage3_two_ranks[0]["fp32"]
    assert result["released"], "after a step the device must hold only the shards again"
    assert not any(result["gathered_after"])
    # Per step: each unit is gathered for forward and again for backward; only the tied embedding twice more.
    steps, psi = 3, result["traffic"]["reduce_scatter"] / 3
    assert result["traffic"]["all_gather"] / steps < 2.5 * psi
