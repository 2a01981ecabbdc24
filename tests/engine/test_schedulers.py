"""Learning-rate schedules: DeepSpeed's numbers at known points, the optimizer's lr, checkpoints, resuming."""

from __future__ import annotations

import io
import math
from itertools import pairwise

import pytest
import torch

from zero_offload.config import load_config
from zero_offload.implementation.schedulers import LRScheduler, build_scheduler, lr_at

# lr_at(kind, params, n, base) is the lr optimizer step n (0-based) runs with. DeepSpeed's position
# while step n runs is last_batch_iteration = n - 1, so DeepSpeed's formulas are written with n - 1 below.

LOG_WARMUP = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10, "warmup_type": "log"}
LINEAR_WARMUP = {
    "warmup_min_lr": 1e-4,
    "warmup_max_lr": 1.1e-3,
    "warmup_num_steps": 10,
    "warmup_type": "linear",
}
DECAY = {**LINEAR_WARMUP, "total_num_steps": 30}
COSINE = {
    "total_num_steps": 110,
    "warmup_min_ratio": 0.1,
    "warmup_num_steps": 10,
    "cos_min_ratio": 0.01,
    "warmup_type": "linear",
}
BASE_LR = 2e-3


def lrs(kind: str, params: dict, steps: range, base_lr: float = BASE_LR) -> list[float]:
    return [lr_at(kind, params, n, base_lr) for n in steps]


def sgd(*lrs_: float) -> torch.optim.SGD:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))], "lr": lr} for lr in lrs_]
    return torch.optim.SGD(groups)


def test_log_warmup():
    # The first two steps both run at warmup_min_lr: DeepSpeed's initial lr, then log(0 + 1) = 0.
    assert lr_at("WarmupLR", LOG_WARMUP, 0, BASE_LR) == 0.0
    assert lr_at("WarmupLR", LOG_WARMUP, 1, BASE_LR) == 0.0
    # Step n runs at max * log(n) / log(10) = max * log10(n); log10 keeps this independent of the code.
    for n in (2, 4, 7):
        assert lr_at("WarmupLR", LOG_WARMUP, n, BASE_LR) == pytest.approx(1e-3 * math.log10(n), rel=1e-12)
    # Log warmup reaches the top on step warmup_num_steps and stays there.
    assert lr_at("WarmupLR", LOG_WARMUP, 9, BASE_LR) < 1e-3
    for n in (10, 11, 500):
        assert lr_at("WarmupLR", LOG_WARMUP, n, BASE_LR) == pytest.approx(1e-3, rel=1e-12)


def test_linear_warmup():
    low, high = 1e-4, 1.1e-3
    assert lr_at("WarmupLR", LINEAR_WARMUP, 0, BASE_LR) == low
    assert lr_at("WarmupLR", LINEAR_WARMUP, 1, BASE_LR) == low
    assert lr_at("WarmupLR", LINEAR_WARMUP, 6, BASE_LR) == pytest.approx((low + high) / 2, rel=1e-12)
    assert lr_at("WarmupLR", LINEAR_WARMUP, 3, BASE_LR) == pytest.approx(low + 0.2 * (high - low), rel=1e-12)
    # Linear warmup is one step later than log: step 10 is at 9/10, step 11 at the top.
    assert lr_at("WarmupLR", LINEAR_WARMUP, 10, BASE_LR) == pytest.approx(low + 0.9 * (high - low), rel=1e-12)
    assert lr_at("WarmupLR", LINEAR_WARMUP, 11, BASE_LR) == pytest.approx(high, rel=1e-12)
    # WarmupLR ignores the optimizer's lr: its values are absolute.
    assert lrs("WarmupLR", LINEAR_WARMUP, range(40), 1.0) == lrs("WarmupLR", LINEAR_WARMUP, range(40), 5.0)


def test_one_warmup_step_counts_as_two():
    # DeepSpeed raises warmup_num_steps to at least 2 (log(1) would be 0).
    params = {**LINEAR_WARMUP, "warmup_num_steps": 1}
    assert lrs("WarmupLR", params, range(4)) == pytest.approx([1e-4, 1e-4, 6e-4, 1.1e-3], rel=1e-12)


def test_warmup_decay():
    low, high = 1e-4, 1.1e-3
    assert lrs("WarmupDecayLR", DECAY, range(11)) == lrs("WarmupLR", LINEAR_WARMUP, range(11))
    # From the top at step 11 down a straight line, (30 - (n - 1)) / (30 - 10) of the way above the floor.
    assert lr_at("WarmupDecayLR", DECAY, 11, BASE_LR) == pytest.approx(high, rel=1e-12)
    assert lr_at("WarmupDecayLR", DECAY, 21, BASE_LR) == pytest.approx((low + high) / 2, rel=1e-12)
    assert lr_at("WarmupDecayLR", DECAY, 30, BASE_LR) == pytest.approx(low + (high - low) / 20, rel=1e-12)
    # At the floor once last_batch_iteration reaches total_num_steps, and never below. The floor is
    # warmup_min_lr, so it is 0 only when warmup starts from 0.
    for n in (31, 32, 1000):
        assert lr_at("WarmupDecayLR", DECAY, n, BASE_LR) == low
        assert lr_at("WarmupDecayLR", {**DECAY, "warmup_min_lr": 0.0}, n, BASE_LR) == 0.0
    assert lr_at("WarmupDecayLR", {**DECAY, "warmup_min_lr": 0.0}, 30, BASE_LR) > 0.0


def test_cosine():
    assert lr_at("WarmupCosineLR", COSINE, 0, BASE_LR) == 0.0  # DeepSpeed's start, not warmup_min_ratio
    assert lr_at("WarmupCosineLR", COSINE, 1, BASE_LR) == pytest.approx(0.1 * BASE_LR, rel=1e-12)
    assert lr_at("WarmupCosineLR", COSINE, 6, BASE_LR) == pytest.approx(0.55 * BASE_LR, rel=1e-12)
    # The cosine starts one step into its descent at step 11: angle pi * 1 / (110 - 10).
    step11 = 0.01 + 0.99 * (1 + math.cos(math.pi / 100)) / 2
    assert lr_at("WarmupCosineLR", COSINE, 11, BASE_LR) == pytest.approx(step11 * BASE_LR, rel=1e-12)
    # Halfway down the cosine (angle pi / 2) the ratio is halfway between 1 and cos_min_ratio.
    assert lr_at("WarmupCosineLR", COSINE, 60, BASE_LR) == pytest.approx(0.505 * BASE_LR, rel=1e-12)
    assert lr_at("WarmupCosineLR", COSINE, 110, BASE_LR) == pytest.approx(0.01 * BASE_LR, rel=1e-12)
    # Past total_num_steps the lr stays at the floor (DeepSpeed clamps the cosine's progress since 0.19.8).
    for n in (111, 150, 1000):
        assert lr_at("WarmupCosineLR", COSINE, n, BASE_LR) == pytest.approx(0.01 * BASE_LR, rel=1e-12)
    # No decay window at all (total_num_steps = warmup): the floor right after warmup.
    no_window = {**COSINE, "total_num_steps": 10}
    assert lr_at("WarmupCosineLR", no_window, 11, BASE_LR) == pytest.approx(0.01 * BASE_LR, rel=1e-12)


def test_cosine_log_warmup_is_relative_to_the_optimizer_lr():
    params = {**COSINE, "warmup_type": "log"}
    for n in (2, 5, 10):
        expected = 0.1 + 0.9 * math.log10(n)
        assert lr_at("WarmupCosineLR", params, n, 3e-4) == pytest.approx(expected * 3e-4, rel=1e-12)
    assert lr_at("WarmupCosineLR", params, 10, 3e-4) == pytest.approx(3e-4, rel=1e-12)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_monotone(warmup_type):
    warm = lrs("WarmupLR", {**LOG_WARMUP, "warmup_type": warmup_type}, range(60))
    assert all(a <= b for a, b in pairwise(warm))
    decay = lrs("WarmupDecayLR", {**DECAY, "warmup_type": warmup_type}, range(11, 60))
    assert all(a >= b for a, b in pairwise(decay))
    cosine = {**COSINE, "warmup_type": warmup_type}
    up, down = lrs("WarmupCosineLR", cosine, range(11)), lrs("WarmupCosineLR", cosine, range(11, 111))
    assert all(a <= b for a, b in pairwise(up))
    assert all(a > b for a, b in pairwise(down))


def test_bad_params():
    with pytest.raises(ValueError, match="OneCycle"):
        lr_at("OneCycle", {}, 0, 1e-3)
    with pytest.raises(ValueError, match="total_num_steps"):
        lr_at("WarmupDecayLR", LINEAR_WARMUP, 0, 1e-3)


def test_sets_the_optimizer_lr_of_every_group():
    optimizer = sgd(1e-3, 4e-3)
    scheduler = LRScheduler(optimizer, "WarmupCosineLR", COSINE)
    assert scheduler.base_lrs == [1e-3, 4e-3]
    for n in range(120):
        expected = [lr_at("WarmupCosineLR", COSINE, n, base) for base in (1e-3, 4e-3)]
        assert [group["lr"] for group in optimizer.param_groups] == expected
        assert scheduler.get_last_lr() == expected
        assert scheduler.steps_applied == n
        scheduler.step()


def test_the_optimizer_really_uses_the_scheduled_lr():
    optimizer = sgd(1.0)
    (param,) = optimizer.param_groups[0]["params"]
    scheduler = LRScheduler(optimizer, "WarmupLR", {**LINEAR_WARMUP, "warmup_min_lr": 0.0})
    seen = []
    for _ in range(5):
        before = param.detach().clone()
        param.grad = torch.ones_like(param)
        optimizer.step()
        seen.append(float((before - param.detach())[0]))  # SGD moves by lr * grad = lr
        scheduler.step()
    assert seen == pytest.approx([0.0, 0.0, 1.1e-4, 2.2e-4, 3.3e-4], rel=1e-5)


def test_state_dict_round_trip():
    optimizer = sgd(1e-3)
    scheduler = LRScheduler(optimizer, "WarmupCosineLR", COSINE)
    for _ in range(7):
        scheduler.step()
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state == {"last_batch_iteration": 6, "base_lrs": [1e-3]}

    # A fresh optimizer whose lr differs: the checkpoint's base lr must win.
    resumed_optimizer = sgd(5e-2)
    resumed = LRScheduler(resumed_optimizer, "WarmupCosineLR", COSINE)
    resumed.load_state_dict(state)
    for _ in range(30):
        assert resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
        scheduler.step()
        resumed.step()


@pytest.mark.parametrize("kind, params", [("WarmupLR", LOG_WARMUP), ("WarmupDecayLR", DECAY)])
def test_last_batch_iteration_resumes(kind, params):
    fresh = LRScheduler(sgd(1e-3), kind, params)
    for _ in range(13):  # 13 applied steps leave last_batch_iteration at 12
        fresh.step()
    resumed = LRScheduler(sgd(1e-3), kind, {**params, "last_batch_iteration": 12})
    assert resumed.steps_applied == 13
    for _ in range(25):
        assert resumed.get_last_lr() == fresh.get_last_lr()
        fresh.step()
        resumed.step()


def test_build_from_config():
    config = load_config(
        {
            "train_batch_size": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {"warmup_num_steps": 4, "total_num_steps": 20, "warmup_max_lr": 3e-4},
            },
        }
    )
    optimizer = sgd(config.optimizer.lr)
    scheduler = build_scheduler(config.scheduler, optimizer)
    assert isinstance(scheduler, LRScheduler)
    # Defaults filled in by the config: log warmup from 0.
    expected = [0.0, 0.0] + [3e-4 * math.log(n) / math.log(4) for n in (2, 3, 4)] + [3e-4]
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    assert seen == pytest.approx(expected, rel=1e-12, abs=0.0)
    assert build_scheduler(load_config({"train_batch_size": 8}).scheduler, optimizer) is None


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_matches_deepspeed(kind, warmup_type):
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    if kind == "WarmupCosineLR":
        params = {**COSINE, "total_num_steps": 40, "warmup_type": warmup_type}
    else:
        params = {**DECAY, "warmup_type": warmup_type}
        if kind == "WarmupLR":
            del params["total_num_steps"]
    theirs, ours = sgd(BASE_LR), sgd(BASE_LR)
    deepspeed_scheduler = getattr(lr_schedules, kind)(theirs, **params)
    scheduler = LRScheduler(ours, kind, params)
    for _ in range(50):  # runs past total_num_steps
        assert ours.param_groups[0]["lr"] == pytest.approx(theirs.param_groups[0]["lr"], rel=1e-12, abs=0.0)
        deepspeed_scheduler.step()
        scheduler.step()
