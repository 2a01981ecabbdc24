"""ZeRO-Offload: the same training as on the device, with the fp32 half of the states really on the host.

Runs compare with one process at stage 0 on the same global batch (tests/support/training.py). Clipping is
on (the norms of this model are about 1.3), so the clip path is compared too; eps is 1e-3 so a wrong gradient
scale shows.
"""

from __future__ import annotations

import pytest
import torch

import zero_offload as zo
from tests.support.distributed import check, run_ranks
from tests.support.training import BATCH, SEQ, make_config, max_rel, train_run
from zero_offload.accelerator import DeviceOutOfMemoryError, EmulatedAccelerator
from zero_offload.basics import estimate_model_states
from zero_offload.implementation.schedulers import lr_at
from zero_offload.workloads import TinyGPT, lm_loss

CPU = {"device": "cpu"}
OFFLOADED = {  # name -> (stage, zero_optimization extras)
    "stage1+opt": (1, {"offload_optimizer": CPU}),
    "stage2+opt": (2, {"offload_optimizer": CPU}),
    "stage3+opt": (3, {"offload_optimizer": CPU}),
    "stage3+opt+param": (3, {"offload_optimizer": CPU, "offload_param": CPU}),
}


def _config(stage, precision="fp32", clip=1.0, **zero):
    config = make_config(stage, precision, **zero)
    config["gradient_clipping"] = clip
    return config


def _offloaded_runs(rank, world_size, precision):
    return {
        name: train_run(rank, world_size, _config(stage, precision, **zero))
        for name, (stage, zero) in OFFLOADED.items()
    }


@pytest.fixture(scope="module")
def reference():
    return {p: train_run(0, 1, _config(0, p)) for p in ("fp32", "fp16")}


def _check_fp32(runs, reference):
    for name, got in runs.items():
        assert max_rel(got["weights"], reference["weights"]) < 1e-6, name
        for ours, theirs in zip(got["norms"], reference["norms"], strict=True):
            assert ours == pytest.approx(theirs, rel=1e-5), name


def test_offloaded_fp32_training_on_one_rank_equals_training_on_the_device(reference):
    _check_fp32(_offloaded_runs(0, 1, "fp32"), reference["fp32"])


@pytest.mark.slow
def test_offloaded_fp32_training_on_two_ranks_equals_one_process(reference):
    for runs in check(run_ranks(_offloaded_runs, 2, "fp32")):
        _check_fp32(runs, reference["fp32"])


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_offloaded_fp16_training_stays_within_the_device_runs_tolerance(reference, world_size):
    fp16_error = max_rel(reference["fp16"]["weights"], reference["fp32"]["weights"])
    assert reference["fp16"]["skipped"] == 0, "the runs must take the same path: no skipped step"
    for runs in check(run_ranks(_offloaded_runs, world_size, "fp16")):
        for name, got in runs.items():
            assert got["skipped"] == 0, name
            assert max_rel(got["weights"], reference["fp16"]["weights"]) <= fp16_error, name


# -- where the bytes live ------------------------------------------------------------------------------------


def _engine(stage=2, precision="fp16", accel=None, **zero):
    zero = {"offload_optimizer": CPU, **zero}
    return zo.initialize(
        TinyGPT("nano"), _config(stage, precision, **zero), accelerator=accel or EmulatedAccelerator()
    )


def _one_step(engine, seed=0):
    x = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    engine.backward(lm_loss(engine(x), x))
    engine.step()


def test_master_weights_moments_and_gradients_are_fp32_host_tensors():
    accel = EmulatedAccelerator()
    engine = _engine(accel=accel)
    _one_step(engine)
    states = engine.states
    for name in ("master", "exp_avg", "exp_avg_sq", "flat_grad"):
        tensor = getattr(states, name)
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu", name
        assert not accel.is_on_device(tensor), f"{name} must live on the host, not on the device"
    assert accel.is_on_device(states.flat_param) and states.flat_param.dtype == torch.float16
    # The optimizer updates the states' own host buffers: it has no moments of its own anywhere else.
    for master, exp_avg in zip(states.master_params, states.exp_avgs, strict=True):
        assert engine.optimizer.state[master]["exp_avg"].data_ptr() == exp_avg.data_ptr()


def test_the_device_keeps_two_bytes_a_parameter_and_buckets_only_while_backward_runs():
    accel = EmulatedAccelerator()
    engine = _engine(accel=accel, reduce_bucket_size=5_000)
    padded = sum(u.padded_numel for u in engine.states.units)
    accel.reset_peak()
    _one_step(engine)
    by_category = accel.memory_stats().by_category
    assert by_category["parameters"] == 2 * padded
    for category in ("gradients", "master_weights", "optimizer_states", "buckets"):
        assert by_category[category] == 0, category
    assert engine.memory_report().measured.device == 2 * padded


def test_the_host_holds_what_the_estimate_says_plus_padding_and_staging():
    engine = _engine()
    states, report = engine.states, engine.memory_report()
    estimate = estimate_model_states(
        engine.num_params, stage=2, world_size=1, offload_optimizer="cpu", precision="fp16"
    )
    assert report.estimated.host == estimate.host == 16 * engine.num_params
    assert report.measured.host == estimate.host + 16 * states.padding["shard"]
    shard = sum(u.shard_numel for u in states.units)
    assert states.host_staging_bytes() == 2 * shard + 2 * shard  # fp16 gradients in, fp16 weights out
    assert report.host_staging == states.host_staging_bytes() and "host staging" in str(report)


def test_only_fp16_crosses_pcie_two_bytes_a_parameter_each_way():
    engine = _engine()
    shard = sum(u.shard_numel for u in engine.states.units)
    _one_step(engine)
    assert engine.states.transfers.bytes == {"d2h": 2 * shard, "h2d": 2 * shard}


def test_stage3_offload_param_keeps_the_weights_on_the_host_and_uploads_each_gather():
    accel = EmulatedAccelerator()
    engine = _engine(stage=3, accel=accel, offload_param=CPU)
    assert not accel.is_on_device(engine.states.flat_param)
    shard = sum(u.shard_numel for u in engine.states.units)
    _one_step(engine)
    assert accel.memory_stats().in_use == 0, "between steps the device holds no model state at all"
    moved = engine.states.transfers.bytes
    assert moved["d2h"] == 2 * shard
    assert moved["h2d"] >= 2 * 2 * shard, "every shard is uploaded for forward and again for backward"


def _overflow_on_rank_one(rank, world_size):
    config = _config(2, "fp16", offload_optimizer=CPU)
    config["fp16"].update(initial_scale_power=8, hysteresis=1)
    engine = zo.initialize(TinyGPT("nano"), config, accelerator=EmulatedAccelerator())
    _one_step(engine, seed=rank)
    states = engine.states
    before = [t.clone() for t in (states.master, states.exp_avg, states.exp_avg_sq, states.flat_param)]
    x = torch.randint(0, 256, (BATCH // world_size, SEQ))
    loss = lm_loss(engine(x), x)
    engine.backward(loss * float("inf") if rank == 1 else loss)
    engine.step()
    after = (states.master, states.exp_avg, states.exp_avg_sq, states.flat_param)
    unchanged = all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    _one_step(engine, seed=rank)  # nothing of the bad step may leak into the next one
    return {
        "unchanged": unchanged,
        "scale": engine.scaler.scale,
        "skipped": engine.skipped_steps,
        "finite": bool(torch.isfinite(states.master).all()),
        "grads_cleared": float(states.flat_grad.abs().sum()),
    }


def test_an_overflow_on_one_rank_skips_the_offloaded_step_everywhere_and_loses_nothing():
    for result in check(run_ranks(_overflow_on_rank_one, 2)):
        assert result == {
            "unchanged": True,
            "scale": 128.0,
            "skipped": 1,
            "finite": True,
            "grads_cleared": 0.0,
        }


def test_gradient_accumulation_sends_each_micro_batch_and_adds_on_the_host():
    config = _config(2, "fp32", offload_optimizer=CPU)
    config.pop("train_batch_size")
    config.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=3)
    accumulated = train_run(0, 1, config, steps=5, accumulation=3)
    reference = train_run(0, 1, _config(0), steps=5)
    assert max_rel(accumulated["weights"], reference["weights"]) < 1e-6
    shard = sum(padded for _, padded in accumulated["units"])
    assert accumulated["pcie"] == {"d2h": 3 * 4 * shard, "h2d": 4 * shard}  # fp32: 4 bytes; 3 micro-batches


def test_offload_fits_a_budget_where_the_device_alone_runs_out():
    unlimited = EmulatedAccelerator()
    _one_step(_engine(accel=unlimited))
    budget = unlimited.memory_stats().peak  # weights, buckets and activations of offloaded training
    stage0 = estimate_model_states(TinyGPT("nano").cfg.num_params(), stage=0, precision="fp16")
    assert stage0.device > budget, "the model states alone must not fit for the comparison to mean anything"
    with pytest.raises(DeviceOutOfMemoryError, match="offload_optimizer"):
        zo.initialize(TinyGPT("nano"), _config(0, "fp16"), accelerator=EmulatedAccelerator(budget))
    accel = EmulatedAccelerator(budget)
    engine = _engine(accel=accel)
    for step in range(3):
        _one_step(engine, seed=step)
    assert accel.memory_stats().peak <= budget and engine.global_steps == 3


def test_the_learning_rate_follows_the_schedule_and_pauses_on_skipped_steps():
    config = _config(2, "fp16", offload_optimizer=CPU)
    params = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4, "warmup_type": "linear"}
    config["scheduler"] = {"type": "WarmupLR", "params": params}
    engine = zo.initialize(TinyGPT("nano"), config, accelerator=EmulatedAccelerator())
    for step in range(6):
        _one_step(engine, seed=step)
    applied = 0
    for record in engine.history:
        assert record["lr"] == pytest.approx(lr_at("WarmupLR", params, applied, 1e-3)), record
        applied += not record["overflow"]


def test_a_deepspeed_users_stage2_offload_config_runs_unchanged():
    config = {  # as DeepSpeed's documentation writes them: float bucket sizes, keys we accept and ignore
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": BATCH // 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 100,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                   "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                                           "warmup_num_steps": 10, "total_num_steps": 100}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                              "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    }  # fmt: skip
    with pytest.warns(UserWarning, match="accepts but ignores"):
        engine = zo.initialize(TinyGPT("nano"), config, accelerator=EmulatedAccelerator())
    for step in range(2):
        for micro in range(2):
            x = torch.randint(
                0, 256, (BATCH // 2, SEQ), generator=torch.Generator().manual_seed(2 * step + micro)
            )
            engine.backward(lm_loss(engine(x), x))
            engine.step()
    assert (
        engine.global_steps == 2
        and engine.states.transfers.bytes["d2h"] == 2 * engine.states.transfers.bytes["h2d"]
    )


@pytest.mark.parametrize("precision, stage", [("fp32", 2), ("fp16", 2), ("fp32", 3), ("fp16", 3)])
def test_the_one_pass_c_adam_trains_like_the_module_3_pipeline(precision, stage, monkeypatch):
    pytest.importorskip("cffi")
    runs = {}
    for impl in ("torch", "simd"):
        zero = {"offload_optimizer": CPU, **({"offload_param": CPU} if stage == 3 else {})}
        config = _config(stage, precision, **zero)
        config["zero_offload"] = {"cpu_adam": {"impl": impl, "threads": 2}}
        if impl == "simd":  # the one pass rounds the weights itself: the separate cast must not run
            monkeypatch.setattr("zero_offload.implementation.offload.upload_weights", None)
        runs[impl] = train_run(0, 1, config, steps=5)
    tolerance = 1e-6 if precision == "fp32" else 1e-3  # fp16: a weight may round to the neighbouring half
    assert max_rel(runs["simd"]["weights"], runs["torch"]["weights"]) < tolerance
    assert runs["simd"]["pcie"] == runs["torch"]["pcie"]


def test_without_a_c_compiler_the_simd_adam_falls_back_with_one_warning(monkeypatch):
    from zero_offload.tuning import build

    def no_compiler(*args, **kwargs):
        raise build.CompilerNotFound("no C compiler found (test)")

    monkeypatch.setattr(build, "build", no_compiler)
    monkeypatch.setattr("zero_offload.tuning.cpu_adam.build", no_compiler)
    config = _config(2, offload_optimizer=CPU)
    config["zero_offload"] = {"cpu_adam": {"impl": "simd"}}
    with pytest.warns(UserWarning, match="Falling back to torch.optim"):
        engine = zo.initialize(TinyGPT("nano"), config, accelerator=EmulatedAccelerator())
    _one_step(engine)
    assert isinstance(engine.optimizer, torch.optim.AdamW) and engine.global_steps == 1


def test_offloading_the_weights_without_the_optimizer_is_refused_with_the_fix():
    config = _config(3, offload_param=CPU)
    with pytest.raises(NotImplementedError, match='"offload_optimizer": {"device": "cpu"}'):
        zo.initialize(TinyGPT("nano"), config, accelerator=EmulatedAccelerator())


def test_one_rank_offloaded_with_clipping_trains_bit_for_bit_like_stage_0():
    """Stage 0 sums the gradient's squares unit by unit, as the offloaded stage does: with the clip active at
    every step the two clip factors, and so the weights, stay equal; rows that crossed units did not."""

    def run(zero: dict) -> zo.Engine:
        config = {
            "train_batch_size": 2,
            "fp16": {"enabled": True, "initial_scale_power": 12},
            "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": zero,
            "zero_offload": {"cpu_adam": {"impl": "torch"}},
        }
        engine = zo.initialize(TinyGPT("nano", seed=0), config, accelerator=EmulatedAccelerator())
        gen = torch.Generator().manual_seed(0)
        for _ in range(4):
            x = torch.randint(0, 256, (2, SEQ), generator=gen)
            engine.backward(lm_loss(engine(x), x))
            engine.step()
        return engine

    device, offloaded = run({"stage": 0}), run({"stage": 2, "offload_optimizer": {"device": "cpu"}})
    norms = [(a["grad_norm"], b["grad_norm"]) for a, b in zip(device.history, offloaded.history, strict=True)]
    assert all(a == b and a > 0.5 for a, b in norms), norms  # equal, and clipped at every step
    for (name, a), (_, b) in zip(
        device.model.named_parameters(), offloaded.model.named_parameters(), strict=True
    ):
        assert torch.equal(a.detach(), b.detach()), name
