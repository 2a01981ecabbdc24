"""The stage-0 engine: equal to plain PyTorch training, honest memory books, clear errors."""

from __future__ import annotations

import gc

import pytest
import torch

import zero_offload as zo
from tests.support.corpus import fixed_corpus
from zero_offload.accelerator import DeviceOutOfMemoryError, EmulatedAccelerator
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss

BATCHES = ByteBatches(fixed_corpus(), 32, seed=3)


def _config(precision="fp32", **extra):
    config = {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01}},
    }
    if precision != "fp32":
        config[precision] = {"enabled": True}
    config.update(extra)
    return config


def _train(engine, steps, micro=4, accumulation=1):
    losses = []
    for step in range(steps):
        for k in range(accumulation):
            x, y = BATCHES.micro_batch(step, micro, micro_step=k, accumulation=accumulation)
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def test_fp32_engine_equals_plain_pytorch_with_clipping():
    ours, plain = TinyGPT("nano"), TinyGPT("nano")
    engine = zo.initialize(ours, _config(gradient_clipping=0.5), accelerator=EmulatedAccelerator())
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.01)
    for step in range(10):
        x, y = BATCHES.global_batch(step, 4)
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        opt.zero_grad()
        lm_loss(plain(x), y).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        opt.step()
    # Ten steps of training amplify rounding (the clipping norm is summed in another order): a few 1e-6.
    for a, b in zip(ours.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert all(r["grad_norm"] > 0.5 for r in engine.history), "the test should exercise clipping"


def test_gradient_accumulation_equals_a_larger_batch():
    one, two = TinyGPT("nano"), TinyGPT("nano")
    big = zo.initialize(one, _config(), accelerator=EmulatedAccelerator())
    small = zo.initialize(
        two,
        _config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2),
        accelerator=EmulatedAccelerator(),
    )
    _train(big, 5, micro=4)
    _train(small, 5, micro=2, accumulation=2)
    assert small.global_steps == big.global_steps == 5
    torch.testing.assert_close(small.states.master, big.states.master, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_states_are_where_and_what_they_should_be(precision):
    model = TinyGPT("nano")
    engine = zo.initialize(model, _config(precision), accelerator=EmulatedAccelerator())
    low = torch.float16 if precision == "fp16" else torch.bfloat16
    states = engine.states
    assert states.flat_param.dtype == low and states.flat_grad.dtype == low
    assert states.master.dtype == states.exp_avg.dtype == states.exp_avg_sq.dtype == torch.float32
    base = states.flat_param.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base and p.dtype == low for p in model.parameters())
    _train(engine, 1)
    grad_base = states.flat_grad.untyped_storage().data_ptr()
    engine.backward(lm_loss(*[engine(BATCHES.global_batch(9, 4)[0]), BATCHES.global_batch(9, 4)[1]]))
    assert all(p.grad.untyped_storage().data_ptr() == grad_base for p in model.parameters()), (
        "autograd must accumulate into the flat gradient buffer"
    )
    torch.testing.assert_close(states.flat_param, states.master.to(low), rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_memory_report_estimate_equals_measurement(precision):
    engine = zo.initialize(TinyGPT("nano"), _config(precision), accelerator=EmulatedAccelerator())
    _train(engine, 2)
    report = engine.memory_report()
    assert report.measured.bytes == report.estimated.bytes
    assert report.measured.device == 16 * engine.num_params
    assert report.device.peak > report.device.in_use, "activations and the fp32 gradient add to the peak"
    assert "estimated" in str(report) and "measured" in str(report)


def test_mixed_precision_training_tracks_fp32():
    losses = {}
    for precision in ("fp32", "fp16", "bf16"):
        engine = zo.initialize(TinyGPT("nano"), _config(precision), accelerator=EmulatedAccelerator())
        losses[precision] = _train(engine, 15)
    assert losses["fp32"][-1] < losses["fp32"][0] - 0.5
    for precision in ("fp16", "bf16"):
        assert abs(losses[precision][-1] - losses["fp32"][-1]) < 0.1, losses


def test_fp16_overflow_backs_off_the_scale_and_training_recovers():
    config = _config("fp16")
    config["fp16"].update(initial_scale_power=40, hysteresis=1)  # 2^40 overflows fp16 gradients at once
    engine = zo.initialize(TinyGPT("nano"), config, accelerator=EmulatedAccelerator())
    losses = _train(engine, 40)
    overflows = [r["step"] for r in engine.history if r["overflow"]]
    assert overflows[:3] == [0, 1, 2] and engine.scaler.scale < 2.0**40
    assert engine.skipped_steps == len(overflows) < 40
    assert losses[-1] < losses[0]


def test_budget_smaller_than_model_states_fails_at_initialize_and_loses_nothing():
    model = TinyGPT("nano")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    states_bytes = 16 * model.cfg.num_params()
    with pytest.raises(DeviceOutOfMemoryError) as err:
        zo.initialize(model, _config("fp16", zero_offload={"device_memory": states_bytes // 2}))
    assert "offload_optimizer" in str(err.value) and "Tried to allocate" in str(err.value)
    gc.collect()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[name]), (
            f"{name} was changed by a failed init"
        )


def test_activations_over_budget_fail_in_forward_with_a_batch_hint():
    model = TinyGPT("nano")
    budget = 16 * model.cfg.num_params() + 4 * model.cfg.num_params() + 64 * 1024
    engine = zo.initialize(model, _config("fp16", zero_offload={"device_memory": budget}))
    with pytest.raises(DeviceOutOfMemoryError, match="train_micro_batch_size_per_gpu"):
        engine(torch.zeros(64, 32, dtype=torch.long))
    gc.collect()
    assert engine.accelerator.memory_stats().by_category["activations"] == 0
    assert all(p.dtype == torch.float16 for p in model.parameters()), (
        "an error mid-forward restores the weights"
    )


def test_model_zero_grad_does_not_break_the_flat_gradients():
    model = TinyGPT("nano")
    engine = zo.initialize(model, _config(), accelerator=EmulatedAccelerator())
    model.zero_grad()  # sets every .grad to None
    _train(engine, 1)
    assert engine.global_steps == 1 and all(p.grad is not None for p in model.parameters())


def test_backward_needs_a_scalar_loss():
    engine = zo.initialize(TinyGPT("nano"), _config(), accelerator=EmulatedAccelerator())
    x, _ = BATCHES.global_batch(0, 4)
    with pytest.raises(ValueError, match="scalar loss"):
        engine.backward(engine(x).sum(dim=-1))


def test_naive_adam_implementation_trains_like_torch():
    a, b = TinyGPT("nano"), TinyGPT("nano")
    naive = zo.initialize(
        a, _config(zero_offload={"cpu_adam": {"impl": "naive"}}), accelerator=EmulatedAccelerator()
    )
    fused = zo.initialize(b, _config(), accelerator=EmulatedAccelerator())
    _train(naive, 5)
    _train(fused, 5)
    torch.testing.assert_close(naive.states.master, fused.states.master, rtol=1e-5, atol=1e-6)


def test_config_from_a_json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_batch_size": 4, "bf16": {"enabled": true}}')
    engine = zo.initialize(TinyGPT("nano"), str(path), accelerator=EmulatedAccelerator())
    assert engine.config.precision == "bf16"


def test_every_states_object_answers_what_the_engine_asks():
    """engine/states.py's States protocol: each tier has every call, with the same keywords."""
    import inspect

    from zero_offload.basics.precision import MixedPrecisionStates
    from zero_offload.engine.states import States
    from zero_offload.implementation.offload import OffloadedStates
    from zero_offload.practice.nvme import NVMeStates
    from zero_offload.principles.zero import ShardedStates

    calls = [name for name, value in vars(States).items() if inspect.isfunction(value) and name[0] != "_"]
    assert {"publish", "each_unit", "gathered", "host_staging_bytes", "record"} <= set(calls)
    for tier in (MixedPrecisionStates, ShardedStates, OffloadedStates, NVMeStates):
        for name in calls:
            assert callable(getattr(tier, name, None)), f"{tier.__name__} has no {name}()"
        assert "rounded" in inspect.signature(tier.publish).parameters, tier
        assert "write" in inspect.signature(tier.each_unit).parameters, tier
    for stage, gathers in ((0, False), (2, False), (3, True)):
        config = {"train_batch_size": 2, "zero_optimization": {"stage": stage}}
        engine = zo.initialize(torch.nn.Linear(4, 4), config, accelerator=EmulatedAccelerator())
        assert engine.states.transfers is None and (engine.states.gathering is not None) == gathers
        assert list(engine.states.each_unit()) == list(range(len(engine.states.master_params)))
        engine.close()
