"""Lab 3 (implementation 实现篇): graded tests. `make lab3` grades your files, `make lab3 LAB_DIR=solutions` the reference.

Each task is tested on its own first (small tensors, exact answers), then inside the engine: ZeRO-2 with CPU
offload must train exactly like the same model without offload. In the engine tests, correct versions of the
other tasks stand in for yours, so one unfinished task cannot fail another.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.support.distributed import check, run_ranks

from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.implementation import offload
from zero_offload.implementation.offload import Transfers
from zero_offload.principles.comm import Comm

pytestmark = pytest.mark.lab3
TASKS = ("3.1", "3.2", "3.3", "3.4")


def _reference_helpers(keep: str, patch=setattr) -> None:
    """Correct versions of every task but `keep`, patched in where the engine looks them up.

    Rank processes patch for good (they exit after the test); in the test process pass monkeypatch.setattr.
    """

    def gradients_to_host(transfers, device_shard, host_staging, host_grad, inv_scale):
        transfers.to_host(host_staging, device_shard)
        host_grad.add_(host_staging, alpha=inv_scale)

    def adam_step(optimizer, masters, grads, clip_factor):
        for master, grad in zip(masters, grads, strict=True):
            master.grad = grad.mul_(clip_factor)
        optimizer.step()
        for master in masters:
            master.grad = None

    def upload_weights(transfers, master, host_low, device_shard):
        if host_low.data_ptr() != master.data_ptr():
            host_low.copy_(master)
        transfers.to_device(device_shard, host_low)

    def overflow_on_any_rank(comm, host_grad):
        return comm.any(not bool(torch.isfinite(host_grad).all()))

    references = {
        "3.1": gradients_to_host,
        "3.2": adam_step,
        "3.3": upload_weights,
        "3.4": overflow_on_any_rank,
    }
    for task, function in references.items():
        if task != keep:
            patch(offload, function.__name__, function)


def _train(
    rank, world_size, keep, *, precision="fp16", offloaded=True, clip=0.0, inject_inf=False, patch=setattr
):
    """ZeRO-2 (+ CPU offload) or stage 0 on the nano GPT for 4 steps; returns what the tests compare."""
    from tests.support.corpus import fixed_corpus

    import zero_offload as zo
    from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss

    _reference_helpers(keep, patch)
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}} if offloaded else {"stage": 0}
    config = {
        "train_batch_size": 4,
        "zero_optimization": zero,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01}},
        # Module 3's Python step, which Lab 3.2 and 3.3 write; module 4's one-pass C Adam would bypass both.
        "zero_offload": {"cpu_adam": {"impl": "torch"}},
    }
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    model = TinyGPT("nano")
    engine = zo.initialize(model, config, accelerator=EmulatedAccelerator())
    data = ByteBatches(fixed_corpus(), 16, seed=3)
    snapshot = None
    for step in range(4):
        x, y = data.micro_batch(step, 4 // world_size, rank=rank, world_size=world_size)
        loss = lm_loss(engine(x), y)
        if inject_inf and step == 2:
            states = engine.states
            snapshot = [
                t.clone() for t in (states.master, states.exp_avg, states.exp_avg_sq, states.flat_param)
            ]
            if rank == world_size - 1:
                loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        if snapshot is not None and step == 2:
            now = (states.master, states.exp_avg, states.exp_avg_sq, states.flat_param)
            snapshot = all(torch.equal(a, b) for a, b in zip(now, snapshot, strict=True))
    return {
        "weights": {n: p.detach().float().clone() for n, p in model.named_parameters()},
        "skipped": engine.skipped_steps,
        "scales": [r["loss_scale"] for r in engine.history],
        "unchanged": snapshot,
        "pcie": dict((engine.states.transfers or Transfers(None)).bytes),
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    }


def _assert_same_weights(got, want, tolerance):
    for name, weight in want.items():
        error = torch.linalg.vector_norm(got[name] - weight) / torch.linalg.vector_norm(weight)
        assert error <= tolerance, f"{name}: relative error {float(error):.2e} (allowed {tolerance:.0e})"


def _engine_equivalence(keep, monkeypatch, precision="fp32", **kwargs):
    """Offloaded training must equal training on the device: fp32 to rounding, fp16 within fp16's own error."""
    offloaded = _train(0, 1, keep, precision=precision, patch=monkeypatch.setattr, **kwargs)
    reference = _train(0, 1, keep, precision=precision, offloaded=False, patch=monkeypatch.setattr, **kwargs)
    _assert_same_weights(offloaded["weights"], reference["weights"], 1e-6 if precision == "fp32" else 2e-3)
    assert offloaded["scales"] == reference["scales"], (
        "the same overflow skips: the loss scale is divided out"
    )
    return offloaded


# ---------------------------------------------------------------------------------------------------- Lab 3.1
def _device(accel, values):
    tensor = accel.empty(values.numel(), values.dtype, category="buckets")
    return tensor.copy_(values)


@pytest.mark.task("3.1")
def test_the_gradient_crosses_as_fp16_and_lands_unscaled_in_fp32():
    accel = EmulatedAccelerator()
    transfers = Transfers(accel)
    values = torch.tensor([1024.0, -2048.0, 3.0, 0.5, 65504.0, 0.0], dtype=torch.float16)
    host_staging, host_grad = torch.empty(6, dtype=torch.float16), torch.zeros(6)
    offload.gradients_to_host(transfers, _device(accel, values), host_staging, host_grad, 1 / 1024)
    assert host_grad.dtype == torch.float32
    torch.testing.assert_close(host_grad, values.float() / 1024, rtol=0, atol=0)
    assert transfers.bytes["d2h"] == 2 * 6, "2 bytes a parameter: the copy must be the fp16 shard, counted"


@pytest.mark.task("3.1")
def test_micro_batches_accumulate_on_the_host():
    accel = EmulatedAccelerator()
    transfers = Transfers(accel)
    host_staging, host_grad = torch.empty(4, dtype=torch.float16), torch.full((4,), 0.25)
    for k in range(3):
        shard = _device(accel, torch.full((4,), 8.0 * (k + 1), dtype=torch.float16))
        offload.gradients_to_host(transfers, shard, host_staging, host_grad, 1 / 8)
    torch.testing.assert_close(host_grad, torch.full((4,), 0.25 + 1 + 2 + 3))
    assert transfers.bytes["d2h"] == 3 * 2 * 4


@pytest.mark.task("3.1")
def test_offloaded_training_with_your_gradient_copy_equals_training_on_the_device(monkeypatch):
    _engine_equivalence("3.1", monkeypatch)
    _engine_equivalence("3.1", monkeypatch, precision="fp16")


# ---------------------------------------------------------------------------------------------------- Lab 3.2
def _adam_case(clip_factor):
    gen = torch.Generator().manual_seed(7)
    masters = [torch.randn(10, generator=gen), torch.randn(6, generator=gen)]
    grads = [torch.randn(10, generator=gen), torch.randn(6, generator=gen)]
    expected = [m.clone() for m in masters]
    for m, g in zip(expected, grads, strict=True):
        m.grad = g * clip_factor
    reference = torch.optim.AdamW(expected, lr=1e-2, eps=1e-3, weight_decay=0.1)
    for _ in range(2):
        reference.step()
    optimizer = torch.optim.AdamW(masters, lr=1e-2, eps=1e-3, weight_decay=0.1)
    return masters, grads, expected, optimizer


@pytest.mark.task("3.2")
@pytest.mark.parametrize("clip_factor", [1.0, 0.25])
def test_one_host_step_is_adamw_on_the_clipped_gradient(clip_factor):
    masters, grads, expected, optimizer = _adam_case(clip_factor)
    for _ in range(2):
        step_grads = [g.clone() for g in grads]  # the step may scale them in place
        offload.adam_step(optimizer, masters, step_grads, clip_factor)
    for got, want in zip(masters, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.task("3.2")
def test_the_gradients_are_handed_back_after_the_step():
    masters, grads, _, optimizer = _adam_case(1.0)
    offload.adam_step(optimizer, masters, grads, 1.0)
    assert all(m.grad is None for m in masters), "a .grad left attached keeps a second reference alive"
    assert all(m in optimizer.state and "exp_avg" in optimizer.state[m] for m in masters)


@pytest.mark.task("3.2")
def test_offloaded_training_with_clipping_equals_training_on_the_device(monkeypatch):
    _engine_equivalence("3.2", monkeypatch, clip=0.5)


# ---------------------------------------------------------------------------------------------------- Lab 3.3
@pytest.mark.task("3.3")
def test_the_weights_are_rounded_on_the_host_and_uploaded_as_fp16():
    accel = EmulatedAccelerator()
    transfers = Transfers(accel)
    master = torch.tensor([1.0 + 2**-11, 1.0 + 3 * 2**-11, -3.14159, 70000.0, 1e-8, 0.0])
    host_low = torch.full((6,), 9.0, dtype=torch.float16)  # last step's weights: must be overwritten first
    device_shard = accel.zeros(6, torch.float16, category="parameters")
    offload.upload_weights(transfers, master, host_low, device_shard)
    expected = master.to(torch.float16)  # round to nearest even: 1 + 2^-11 -> 1.0, 1 + 3 * 2^-11 -> 1 + 2^-9
    assert torch.equal(device_shard, expected) and torch.equal(host_low, expected)
    assert transfers.bytes == {"h2d": 2 * 6}, "only fp16 crosses the link, counted once"


@pytest.mark.task("3.3")
def test_fp32_training_uploads_the_master_itself():
    accel = EmulatedAccelerator()
    transfers = Transfers(accel)
    master = torch.randn(5)
    device_shard = accel.zeros(5, torch.float32, category="parameters")
    offload.upload_weights(transfers, master, master, device_shard)
    assert torch.equal(device_shard, master) and transfers.bytes == {"h2d": 4 * 5}


@pytest.mark.task("3.3")
def test_offloaded_training_with_your_upload_equals_training_on_the_device(monkeypatch):
    _engine_equivalence("3.3", monkeypatch)
    fp16 = _engine_equivalence("3.3", monkeypatch, precision="fp16")
    assert fp16["pcie"]["h2d"] == fp16["pcie"]["d2h"], (
        "each step: fp16 weights up, as many bytes as gradients down"
    )


# ---------------------------------------------------------------------------------------------------- Lab 3.4
@pytest.mark.task("3.4")
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), None])
def test_a_single_bad_value_is_an_overflow(bad):
    grad = torch.ones(1000)
    if bad is not None:
        grad[617] = bad
    assert offload.overflow_on_any_rank(Comm(), grad) is (bad is not None)


def _overflow_ranks(rank, world_size):
    comm = Comm()
    grad = torch.ones(64)
    if rank == 1:
        grad[5] = float("nan")
    return {
        "flag": offload.overflow_on_any_rank(comm, grad),
        "clean": offload.overflow_on_any_rank(comm, torch.ones(8)),
    }


@pytest.mark.task("3.4")
def test_every_rank_agrees_when_one_rank_overflows():
    for rank, result in enumerate(check(run_ranks(_overflow_ranks, 2))):
        assert result == {"flag": True, "clean": False}, f"rank {rank}: {result}"


def _inject(rank, world_size):
    return _train(rank, world_size, "3.4", inject_inf=True)


@pytest.mark.task("3.4")
def test_an_inf_on_one_rank_skips_the_step_everywhere_and_loses_nothing():
    for rank, result in enumerate(check(run_ranks(_inject, 2))):
        assert result["skipped"] == 1, (
            f"rank {rank} skipped {result['skipped']} steps, every rank must skip 1"
        )
        assert result["unchanged"], (
            f"rank {rank}: master weights, moments or fp16 weights changed in the skip"
        )
        assert result["scales"][3] == result["scales"][2] / 2, f"rank {rank}: the loss scale must halve"
        assert result["finite"], f"rank {rank}: an inf reached the weights"
