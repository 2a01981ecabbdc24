"""Partial offload (`offload_optimizer.ratio`, tuning/partial.py): a share of the units keeps its optimizer on the
device. The training is the same; the bytes move between the tiers as the ratio says."""

from __future__ import annotations

import pytest
import torch

import zero_offload as zo
from tests.support.distributed import check, run_ranks
from tests.support.training import BATCH, SEQ, make_config, max_rel, train_run
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.tuning.partial import host_unit_count
from zero_offload.workloads import TinyGPT, lm_loss


def _partial(ratio, **zero):
    return {"offload_optimizer": {"device": "cpu", "ratio": ratio}, **zero}


def test_the_host_takes_the_leading_units_whose_share_is_closest_to_the_ratio():
    sizes = [40, 10, 30, 20]
    assert host_unit_count(sizes, 1.0) == 4
    assert host_unit_count(sizes, 0.5) == 2  # 40 + 10 is exactly half
    assert host_unit_count(sizes, 0.6) == 2  # 50 is closer to 60 than 80
    assert host_unit_count(sizes, 0.7) == 3  # a tie between 50 and 80 puts more on the host
    assert (
        host_unit_count(sizes, 0.1) == 0
    )  # the first unit alone would be 40%: closer to keep all on the device


@pytest.fixture(scope="module")
def reference():
    return train_run(0, 1, make_config(0, "fp32"))


def _runs(rank, world_size, precision="fp32"):
    return {
        ratio: train_run(rank, world_size, make_config(2, precision, **_partial(ratio)))
        for ratio in (0.3, 0.7)
    }


def test_partial_offload_trains_like_the_device_on_one_rank(reference):
    for ratio, got in _runs(0, 1).items():
        assert max_rel(got["weights"], reference["weights"]) < 1e-6, ratio
        for ours, theirs in zip(got["norms"], reference["norms"], strict=True):
            assert ours == pytest.approx(theirs, rel=1e-5), ratio


@pytest.mark.slow
def test_partial_offload_on_two_ranks_equals_one_process(reference):
    for runs in check(run_ranks(_runs, 2)):
        for ratio, got in runs.items():
            assert max_rel(got["weights"], reference["weights"]) < 1e-6, ratio


def test_fp16_partial_offload_stays_within_the_device_runs_tolerance(reference):
    device = train_run(0, 1, make_config(0, "fp16"))
    fp16_error = max_rel(device["weights"], reference["weights"])
    got = train_run(0, 1, make_config(2, "fp16", **_partial(0.5)))
    assert got["skipped"] == device["skipped"] == 0
    assert max_rel(got["weights"], device["weights"]) <= fp16_error


def _engine(ratio, precision="fp16"):
    accel = EmulatedAccelerator()
    engine = zo.initialize(TinyGPT("nano"), make_config(2, precision, **_partial(ratio)), accelerator=accel)
    x = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    engine.backward(lm_loss(engine(x), x))
    engine.step()
    return engine, accel


def test_each_units_states_live_where_the_split_puts_them():
    engine, accel = _engine(0.5)
    states, split = engine.states, engine.states.host_units
    assert 0 < split < len(states.units)
    for index, (master, m, v) in enumerate(
        zip(states.master_params, states.exp_avgs, states.exp_avg_sqs, strict=True)
    ):
        on_host = index < split
        for name, tensor in (("master", master), ("exp_avg", m), ("exp_avg_sq", v)):
            assert tensor.dtype == torch.float32, name
            assert accel.is_on_device(tensor) != on_host, f"unit {index} {name}: on the host is {on_host}"
        assert engine.optimizer.state[master]["exp_avg"].data_ptr() == m.data_ptr()
    # Only the host's units cross PCIe: their fp16 gradients down, their fp16 weights up.
    host_numel = sum(u.shard_numel for u in states.units[:split])
    assert states.transfers.bytes["d2h"] == states.transfers.bytes["h2d"] == 2 * host_numel


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_the_estimate_matches_the_measured_bytes_and_the_ratio_moves_them(precision):
    tiers = {}
    for ratio in (0.25, 0.5, 1.0):
        engine, _ = _engine(ratio, precision)
        report = engine.memory_report()
        assert report.estimated.bytes == report.measured.bytes, (
            ratio
        )  # one rank of the nano model: no padding
        tiers[ratio] = (report.measured.device, report.measured.host)
    devices, hosts = zip(*(tiers[r] for r in (0.25, 0.5, 1.0)), strict=True)
    assert devices[0] > devices[1] > devices[2] and hosts[0] < hosts[1] < hosts[2]


def test_a_partial_offload_with_the_weights_on_the_host_is_refused_with_the_fix():
    zero = {**_partial(0.5), "offload_param": {"device": "cpu"}}
    with pytest.raises(NotImplementedError, match="offload_optimizer.ratio.*offload_param"):
        zo.initialize(TinyGPT("nano"), make_config(3, "fp16", **zero), accelerator=EmulatedAccelerator())
