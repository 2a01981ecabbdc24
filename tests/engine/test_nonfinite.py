"""Non-finite values never reach the master weights: an inf/nan loss or gradient norm skips the step in every
precision and on every path, a norm found non-finite only after Adam ran is a clear error, and a run that keeps
skipping stops with an error naming the step and the last checkpoint.

fp16's own overflow skip (the scale halves) is tested in test_engine.py and test_zero.py and must not change.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import zero_offload as zo
from tests.support.distributed import check, run_ranks
from tests.support.training import BATCH, SEQ, make_config
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.engine.divergence import TrainingDivergedError
from zero_offload.workloads import TinyGPT, lm_loss

NAN = float("nan")
CPU = {"device": "cpu"}


def _config(stage, precision="fp32", *, clip=0.0, offload=False, impl="torch", accumulation=1, **ext):
    config = make_config(stage, precision)
    if accumulation > 1:
        del config["train_batch_size"]
        config.update(
            train_micro_batch_size_per_gpu=BATCH // accumulation, gradient_accumulation_steps=accumulation
        )
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    config["gradient_clipping"] = clip
    if offload:
        config["zero_optimization"]["offload_optimizer"] = CPU
    config["zero_offload"] = {"cpu_adam": {"impl": impl}, **ext}
    return config


def _engine(config):
    return zo.initialize(TinyGPT("nano", seed=0), config, accelerator=EmulatedAccelerator())


def _batch(step, rank=0, world_size=1):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 256, (BATCH // world_size, SEQ), generator=gen)


def _step(engine, step, *, poison=None, rank=0, world_size=1):
    """One optimizer step over the engine's micro-batches; `poison(k, loss)` may replace micro-batch k's loss."""
    accumulation = engine.gradient_accumulation_steps
    x = _batch(step, rank, world_size)
    for k, chunk in enumerate(x.chunk(accumulation)):
        loss = lm_loss(engine(chunk), chunk)
        if poison is not None:
            loss = poison(k, loss)
        engine.backward(loss)
        engine.step()
    return float(loss.detach())


def _states(engine) -> list[torch.Tensor]:
    """Every master weight and both moments, as copies (the delayed update lands first)."""
    engine.synchronize()
    s = engine.states
    return [t.detach().clone() for t in (*s.master_params, *s.exp_avgs, *s.exp_avg_sqs)]


def _bitwise_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _nan_loss(k, loss):
    return loss * NAN


def _check_nan_loss_is_skipped(config, *, poison=_nan_loss):
    engine = _engine(config)
    _step(engine, 0)
    _step(engine, 1)
    before = _states(engine)
    with pytest.warns(RuntimeWarning, match=r"step 3 skipped \(non-finite loss\)"):
        _step(engine, 2, poison=poison)
    after = _states(engine)
    assert _bitwise_equal(after, before), "an inf/nan loss reached the master weights or the moments"
    assert all(bool(torch.isfinite(t).all()) for t in after)
    record = engine.history[-1]
    assert record["overflow"] and record["skipped"] == "non-finite loss" and engine.skipped_steps == 1
    losses = [_step(engine, step) for step in (3, 4)]
    assert all(r["skipped"] is None and r["grad_norm"] > 0 for r in engine.history[-2:]), engine.history[-2:]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert not _bitwise_equal(_states(engine), before), "training must go on after the skip"
    return engine


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage,clip", [(0, 0.0), (2, 0.0), (2, 1.0), (3, 0.0)])
def test_a_nan_loss_skips_the_step_and_training_goes_on(precision, stage, clip):
    engine = _check_nan_loss_is_skipped(_config(stage, precision, clip=clip))
    if stage == 3:  # the units the poisoned forward gathered were released with the skipped backward
        assert not any(unit.gathered for unit in engine.states.units)


def test_an_inf_loss_in_one_micro_batch_skips_the_whole_accumulation_window():
    config = _config(2, accumulation=2)
    _check_nan_loss_is_skipped(config, poison=lambda k, loss: loss * float("inf") if k == 0 else loss)


@pytest.mark.parametrize("impl", ["torch", "simd"])  # simd without clipping: the norm is summed inside Adam
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_nan_loss_never_reaches_the_weights_through_the_eager_pipeline(impl, accumulation):
    _check_nan_loss_is_skipped(
        _config(2, "bf16", offload=True, impl=impl, overlap_offload=True, accumulation=accumulation)
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_a_nan_loss_never_reaches_the_weights_under_the_delayed_update(overlap):
    dpu = {"enabled": True, "start_step": 1}
    _check_nan_loss_is_skipped(
        _config(2, offload=True, impl="simd", overlap_offload=overlap, delayed_param_update=dpu)
    )


def _nan_loss_on_rank_one(rank, world_size, stage):
    engine = _engine(_config(stage))
    _step(engine, 0, rank=rank, world_size=world_size)
    before = _states(engine)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _step(engine, 1, rank=rank, world_size=world_size, poison=_nan_loss if rank == 1 else None)
    unchanged = _bitwise_equal(_states(engine), before)
    skipped = engine.history[-1]["skipped"]
    _step(engine, 2, rank=rank, world_size=world_size)
    with engine.gathered_parameters():
        weights = torch.cat([p.detach().reshape(-1).float() for p in engine.params])
    return {
        "unchanged": unchanged,
        "skipped": skipped,
        "weights": weights,
        "norm": engine.history[-1]["grad_norm"],
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank(stage):
    results = check(run_ranks(_nan_loss_on_rank_one, 2, stage))
    for result in results:
        assert result["unchanged"] and result["skipped"] == "non-finite loss"
        assert torch.isfinite(result["weights"]).all() and result["norm"] > 0
    assert torch.equal(results[0]["weights"], results[1]["weights"])


def _nan_gradient_once(engine):
    """Puts a nan into one gradient during the next backward only; the loss stays finite."""
    param = engine.params[-1]
    armed = [True]

    def hook(grad):
        if armed[0]:
            armed[0] = False
            return grad * NAN
        return grad

    param.register_hook(hook)


@pytest.mark.parametrize(
    "stage,extra",
    [
        (0, {}),
        (2, {}),
        (2, {"offload": True}),
        (2, {"offload": True, "impl": "simd", "clip": 1.0}),  # clipping: the norm is known before the C Adam
        (2, {"offload": True, "impl": "simd", "clip": 1.0, "overlap_offload": True}),
        (2, {"offload": True, "delayed_param_update": {"enabled": True, "start_step": 0}}),
    ],
)
def test_a_nan_gradient_with_a_finite_loss_is_skipped_where_the_norm_comes_before_adam(stage, extra):
    engine = _engine(_config(stage, **extra))
    _step(engine, 0)
    before = _states(engine)
    _nan_gradient_once(engine)
    with pytest.warns(RuntimeWarning, match=r"step 2 skipped \(non-finite gradient norm\)"):
        loss = _step(engine, 1)
    assert loss == loss, "the loss itself is finite"
    assert _bitwise_equal(_states(engine), before)
    assert engine.history[-1]["skipped"] == "non-finite gradient norm"
    _step(engine, 2)
    assert engine.history[-1]["skipped"] is None and all(torch.isfinite(t).all() for t in _states(engine))


@pytest.mark.parametrize("overlap", [False, True])
def test_a_nan_gradient_that_adam_applied_before_its_norm_was_known_is_a_clear_error(overlap):
    engine = _engine(_config(2, "bf16", offload=True, impl="simd", overlap_offload=overlap))
    if not (overlap or engine.optimizer_step.norm_in_adam):
        pytest.skip("the C Adam could not be built here (no C compiler)")
    _step(engine, 0)
    _nan_gradient_once(engine)
    with pytest.raises(TrainingDivergedError, match=r"step 2: the gradient norm is nan") as err:
        _step(engine, 1)
    message = str(err.value)
    assert "non-finite values" in message and "gradient_clipping" in message
    assert "No checkpoint has been saved or loaded yet" in message


@pytest.mark.parametrize("stage", [0, 2])
def test_nan_losses_in_a_row_stop_the_run_naming_the_step_and_the_last_checkpoint(tmp_path, stage):
    engine = _engine(_config(stage, max_skipped_steps=3))
    _step(engine, 0)
    engine.save_checkpoint(tmp_path / "ckpt")
    with pytest.warns(RuntimeWarning):
        _step(engine, 1, poison=_nan_loss)  # step 2
        _step(engine, 2, poison=_nan_loss)
    _step(engine, 3)  # a good step starts the count again
    saved = _states(engine)
    with pytest.warns(RuntimeWarning) as seen:
        _step(engine, 4, poison=_nan_loss)  # step 5
        _step(engine, 5, poison=_nan_loss)
    assert [str(w.message).split("; ")[1].split(",")[0] for w in seen] == ["1 in a row", "2 in a row"]
    with pytest.raises(TrainingDivergedError) as err:
        _step(engine, 6, poison=_nan_loss)  # step 7
    message = str(err.value)
    assert "step 7 is the 3rd step in a row skipped (non-finite loss)" in message
    assert "nothing has been applied since step 4" in message
    assert f"The last checkpoint is {tmp_path / 'ckpt'} (step 1)" in message
    assert "max_skipped_steps" in message
    # The step's bookkeeping was finished before the error: consistent, unchanged, still savable.
    assert engine.global_steps == 7 and engine.skipped_steps == 5 and len(engine.history) == 7
    assert _bitwise_equal(_states(engine), saved)


def test_fp16_overflowing_at_min_loss_scale_stops_after_the_limit():
    config = _config(2, "fp16", max_skipped_steps=4)
    config["fp16"] = {"enabled": True, "initial_scale_power": 3, "min_loss_scale": 2, "hysteresis": 1}
    engine = _engine(config)
    inf = lambda k, loss: loss * float("inf")  # noqa: E731
    _step(engine, 0, poison=inf)  # 8 -> 4: the scaler still had a move, nothing counted, nothing said
    with pytest.warns(RuntimeWarning, match="fp16 loss scale 2 sits at min_loss_scale"):
        for step in (1, 2, 3):  # 4 -> 2, then 2 stays: counted from the step that finds it at the floor
            _step(engine, step, poison=inf)
    with pytest.warns(RuntimeWarning, match="3 in a row, training stops at 4"):
        _step(engine, 4, poison=inf)
    with pytest.raises(TrainingDivergedError, match="4th step in a row skipped \\(fp16 overflow; the fp16 loss "
                       "scale 2 sits at min_loss_scale and cannot go lower\\)"):  # fmt: skip
        _step(engine, 5, poison=inf)
    assert engine.global_steps == 6 and engine.scaler.scale == 2.0


def test_fp16_backing_off_from_a_high_scale_is_not_counted_as_diverging():
    config = _config(0, "fp16", max_skipped_steps=2)
    config["fp16"] = {"enabled": True, "initial_scale_power": 40, "hysteresis": 1}
    engine = _engine(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no skip-streak warning either
        for step in range(30):
            _step(engine, step)
    skipped = [r["step"] for r in engine.history if r["skipped"]]
    assert skipped[:3] == [0, 1, 2] and len(skipped) > 2
    assert all(r["skipped"] == "fp16 overflow" for r in engine.history if r["overflow"])
