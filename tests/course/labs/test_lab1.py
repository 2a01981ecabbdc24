"""Lab 1 (basics 基础篇): graded tests. Run them with `make lab1` (your code) or `make lab1 LAB_DIR=solutions`.

Each test carries the id of the task it grades ("Lab 1.2" in the stub, the course page and here).
The references below are written independently of the engine, in float64, from the formulas of chapter 01.
"""

from __future__ import annotations


import pytest
import torch

from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.basics import adam as adam_module
from zero_offload.basics.adam import Adam, adam_update, update_moments
from zero_offload.basics.memory import MemoryLedger, estimate_model_states
from zero_offload.basics.precision import DynamicLossScaler, MixedPrecisionStates, unique_parameters
from zero_offload.workloads import TinyGPT

pytestmark = pytest.mark.lab1


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _reference_moments(m, v, g, beta1, beta2):
    return beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g


# ---------------------------------------------------------------------------------------------------- Lab 1.1
@pytest.mark.task("1.1")
def test_moments_one_step_match_the_formula():
    m, v, g = _rand(1000, seed=1), _rand(1000, seed=2).abs(), _rand(1000, seed=3)
    want_m, want_v = _reference_moments(m.double(), v.double(), g.double(), 0.8, 0.95)
    update_moments(m, v, g, 0.8, 0.95)
    torch.testing.assert_close(m.double(), want_m, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v.double(), want_v, rtol=1e-6, atol=1e-7)


@pytest.mark.task("1.1")
def test_moments_update_in_place_and_leave_the_gradient_alone():
    m, v, g = torch.zeros(64), torch.zeros(64), _rand(64, seed=4)
    m_ptr, v_ptr, g_before = m.data_ptr(), v.data_ptr(), g.clone()
    update_moments(m, v, g, 0.9, 0.999)
    assert m.data_ptr() == m_ptr and v.data_ptr() == v_ptr
    assert m.abs().sum() > 0 and v.abs().sum() > 0, "exp_avg / exp_avg_sq must be updated in place"
    assert torch.equal(g, g_before), "update_moments must not modify the gradient"


@pytest.mark.task("1.1")
def test_moments_follow_the_recurrence_over_many_steps():
    m, v = torch.zeros(32, dtype=torch.float64), torch.zeros(32, dtype=torch.float64)
    want_m, want_v = m.clone(), v.clone()
    for step in range(20):
        g = _rand(32, seed=100 + step, dtype=torch.float64)
        update_moments(m, v, g, 0.9, 0.99)
        want_m, want_v = _reference_moments(want_m, want_v, g, 0.9, 0.99)
    torch.testing.assert_close(m, want_m)
    torch.testing.assert_close(v, want_v)


# ---------------------------------------------------------------------------------------------------- Lab 1.2
@pytest.fixture
def reference_moments(monkeypatch):
    """Grade 1.2 on its own: a correct update_moments stands in for the learner's, whatever state 1.1 is in."""

    def moments(exp_avg, exp_avg_sq, grad, beta1, beta2):
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

    monkeypatch.setattr(adam_module, "update_moments", moments)


def _reference_adam(p, grads, *, lr, betas, eps, wd, adamw, bias_correction=True):
    p, m, v = (
        p.double().clone(),
        torch.zeros_like(p, dtype=torch.float64),
        torch.zeros_like(p, dtype=torch.float64),
    )
    for t, g in enumerate(grads, start=1):
        g = g.double()
        if wd and adamw:
            p = p * (1 - lr * wd)
        elif wd:
            g = g + wd * p
        m, v = _reference_moments(m, v, g, *betas)
        c1 = 1 - betas[0] ** t if bias_correction else 1.0
        c2 = 1 - betas[1] ** t if bias_correction else 1.0
        p = p - lr * (m / c1) / ((v / c2).sqrt() + eps)
    return p


@pytest.mark.task("1.2")
@pytest.mark.parametrize("adamw", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_update_matches_the_formula(reference_moments, adamw, wd):
    p0 = _rand(500, seed=5)
    grads = [_rand(500, seed=10 + t) for t in range(8)]
    p, m, v = p0.clone(), torch.zeros(500), torch.zeros(500)
    for t, g in enumerate(grads, start=1):
        adam_update(p, g, m, v, step=t, lr=1e-2, betas=(0.8, 0.95), eps=1e-3, weight_decay=wd, adamw=adamw)
    want = _reference_adam(p0, grads, lr=1e-2, betas=(0.8, 0.95), eps=1e-3, wd=wd, adamw=adamw)
    torch.testing.assert_close(p.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.task("1.2")
def test_bias_correction_can_be_turned_off(reference_moments):
    p0, g = _rand(100, seed=6), _rand(100, seed=7)
    p, m, v = p0.clone(), torch.zeros(100), torch.zeros(100)
    adam_update(p, g, m, v, step=1, lr=1e-2, eps=1e-3, bias_correction=False)
    want = _reference_adam(
        p0, [g], lr=1e-2, betas=(0.9, 0.999), eps=1e-3, wd=0.0, adamw=False, bias_correction=False
    )
    torch.testing.assert_close(p.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.task("1.2")
def test_update_leaves_the_gradient_alone(reference_moments):
    p, g = _rand(100, seed=8), _rand(100, seed=9)
    g_before = g.clone()
    adam_update(p, g, torch.zeros(100), torch.zeros(100), step=1, lr=1e-2, weight_decay=0.1)
    assert torch.equal(g, g_before), "Adam's L2 term must not be added to the caller's gradient in place"


@pytest.mark.task("1.2")
@pytest.mark.parametrize("adamw", [False, True], ids=["Adam", "AdamW"])
def test_optimizer_matches_torch_over_30_steps(reference_moments, adamw):
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    theirs.load_state_dict(ours.state_dict())
    kwargs = dict(lr=3e-3, betas=(0.85, 0.98), eps=1e-3, weight_decay=0.05)
    opt = Adam(ours.parameters(), adamw=adamw, **kwargs)
    ref = (torch.optim.AdamW if adamw else torch.optim.Adam)(theirs.parameters(), **kwargs)
    for step in range(30):
        x = _rand(4, 16, seed=200 + step)
        for model, optimizer in ((ours, opt), (theirs, ref)):
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- Lab 1.3
P, N = 1000, 4  # shard = 250


@pytest.mark.task("1.3")
def test_13b_model_needs_208_gb_not_156():
    est = estimate_model_states(13_000_000_000, precision="fp16")
    assert est.device == 208_000_000_000 and est.host == 0 and est.nvme == 0
    assert est.bytes["master_weights"]["device"] == 52_000_000_000


@pytest.mark.task("1.3")
@pytest.mark.parametrize(
    "kwargs, device, host, nvme",
    [
        (dict(stage=0), 16 * P, 0, 0),
        (dict(stage=0, precision="fp32"), 16 * P, 0, 0),
        (dict(stage=1, world_size=N), 2 * P + 2 * P + 12 * 250, 0, 0),
        (dict(stage=2, world_size=N), 2 * P + 2 * 250 + 12 * 250, 0, 0),
        (dict(stage=3, world_size=N), 16 * 250, 0, 0),
        (dict(stage=2, world_size=N, precision="fp32"), 4 * P + 4 * 250 + 8 * 250, 0, 0),
        (dict(stage=2, world_size=1, offload_optimizer="cpu"), 2 * P, 16 * P, 0),
        (dict(stage=2, world_size=N, offload_optimizer="cpu"), 2 * P, 16 * 250, 0),
        (dict(stage=1, world_size=N, offload_optimizer="cpu", precision="bf16"), 2 * P, 16 * 250, 0),
        (dict(stage=2, world_size=N, offload_optimizer="cpu", precision="fp32"), 4 * P, 16 * 250, 0),
        (dict(stage=3, world_size=N, offload_optimizer="cpu", offload_param="cpu"), 0, 18 * 250, 0),
        (dict(stage=3, world_size=N, offload_optimizer="nvme", offload_param="nvme"), 0, 4 * 250, 14 * 250),
    ],
)
def test_bytes_per_tier(kwargs, device, host, nvme):
    est = estimate_model_states(P, **kwargs)
    assert (est.device, est.host, est.nvme) == (device, host, nvme), kwargs


@pytest.mark.task("1.3")
def test_uneven_shards_round_up():
    est = estimate_model_states(10, stage=3, world_size=3)  # shards of 4, 4, 2 elements: a rank holds 4
    assert est.device == 16 * 4


@pytest.mark.task("1.3")
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_estimate_equals_the_ledger_for_the_tiny_gpt(precision):
    accel = EmulatedAccelerator()
    model = TinyGPT("nano")
    states = MixedPrecisionStates(unique_parameters(model), accel, precision)
    ledger = MemoryLedger(accel)
    ledger.record("parameters", states.flat_param)
    ledger.record("gradients", states.flat_grad)
    ledger.record("master_weights", states.master)
    ledger.record("exp_avg", states.exp_avg)
    ledger.record("exp_avg_sq", states.exp_avg_sq)
    measured = ledger.measure()
    est = estimate_model_states(model.cfg.num_params(), precision=precision)
    assert measured.bytes == est.bytes


# ---------------------------------------------------------------------------------------------------- Lab 1.4
def _run(scaler, pattern):
    """Feed a pattern like 'o.o' (o = overflow, . = good step); return the scale after each step."""
    scales = []
    for c in pattern:
        scaler.update(c == "o")
        scales.append(scaler.scale)
    return scales


@pytest.mark.task("1.4")
def test_overflow_backs_off_at_once_without_hysteresis():
    scaler = DynamicLossScaler(1024.0, hysteresis=1, scale_window=100, min_scale=64.0)
    assert _run(scaler, "ooooo") == [512.0, 256.0, 128.0, 64.0, 64.0]


@pytest.mark.task("1.4")
def test_hysteresis_tolerates_overflows_before_backing_off():
    scaler = DynamicLossScaler(1024.0, hysteresis=3, scale_window=100)
    assert _run(scaler, "oooo") == [1024.0, 1024.0, 512.0, 256.0]


@pytest.mark.task("1.4")
def test_scale_grows_after_a_window_of_good_steps_and_restores_patience():
    scaler = DynamicLossScaler(8.0, hysteresis=2, scale_window=3)
    assert _run(scaler, "..o.....") == [8.0, 8.0, 8.0, 8.0, 8.0, 16.0, 16.0, 16.0]
    # the growth restored the patience: one overflow is tolerated again, the second backs off
    assert _run(scaler, "oo") == [16.0, 8.0]


@pytest.mark.task("1.4")
def test_consecutive_hysteresis_restores_patience_every_good_step():
    plain = DynamicLossScaler(64.0, hysteresis=2, scale_window=100)
    consecutive = DynamicLossScaler(64.0, hysteresis=2, scale_window=100, consecutive_hysteresis=True)
    assert _run(plain, "o.o") == [64.0, 64.0, 32.0]
    assert _run(consecutive, "o.o") == [64.0, 64.0, 64.0]


@pytest.mark.task("1.4")
def test_an_overflowing_step_changes_no_weight():
    import zero_offload as zo

    model = TinyGPT("nano")
    config = {
        "train_batch_size": 2,
        "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    engine = zo.initialize(model, config, accelerator=EmulatedAccelerator())
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()  # one good step, so the moments are not all zero
    before = [t.clone() for t in (engine.states.master, engine.states.exp_avg, engine.states.exp_avg_sq)]
    engine.backward(engine(x).float().pow(2).mean())
    engine.states.flat_grad[7] = float("inf")
    engine.step()
    after = (engine.states.master, engine.states.exp_avg, engine.states.exp_avg_sq)
    for b, a in zip(before, after, strict=True):
        assert torch.equal(a, b), "an overflowing step must leave master weights and moments bit-identical"
    assert engine.scaler.scale == 2.0**7 and engine.skipped_steps == 1
    assert not engine.states.flat_grad.any(), "the overflowing gradients must be cleared"
