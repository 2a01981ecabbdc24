"""Checkpoints: save, load into a fresh engine, continue, and get the losses of training straight through.

Every resume starts from a model initialised with another seed, so that whatever the resumed run trains on
must have come from the checkpoint. Same world size: equal bit for bit. Another world size or stage: equal
up to the order in which gradients are summed.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import stat

import pytest
import torch

import zero_offload as zo
from tests.support.corpus import fixed_corpus
from tests.support.distributed import check, run_ranks
from tests.support.training import BATCH, SEQ, make_config, max_rel
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.cli import main
from zero_offload.implementation.checkpoint import FORMAT, CheckpointError, consolidate
from zero_offload.workloads import ByteBatches, TinyGPT, gpt_config, lm_loss

BATCHES = ByteBatches(fixed_corpus(), SEQ, seed=5)
SAVE_AT, STEPS = 3, 5  # save after 3 steps, then 2 more
CPU = {"device": "cpu"}


def _config(stage=0, precision="fp32", scheduler=False, **zero):
    config = make_config(stage, **zero)  # eps 1e-3: a lost v shows in the update (DESIGN.md testing notes)
    if precision == "fp16":
        # Too high a start: the first steps overflow and are skipped, then a window of 2 raises the scale
        # again, so the resumed run goes wrong unless the scaler's whole state came back.
        config["fp16"] = {"enabled": True, "initial_scale_power": 18, "loss_scale_window": 2}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    if scheduler:
        config["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10},
        }
    return config


def _engine(config, seed=0, model="nano"):
    return zo.initialize(TinyGPT(model, seed=seed), config, accelerator=EmulatedAccelerator())


def _train(engine, steps, rank=0, world_size=1) -> list[float]:
    losses = []
    for step in steps:
        x, y = BATCHES.micro_batch(step, BATCH // world_size, rank=rank, world_size=world_size)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _snapshot(engine) -> dict:
    """What decides the next step: fp32 masters, both moments, Adam's step counts, scaler, lr and counters."""
    state = engine.optimizer.state
    masters = engine.states.master_params
    return {
        "master": [m.detach().clone() for m in masters],
        "exp_avg": [state[m]["exp_avg"].clone() for m in masters],
        "exp_avg_sq": [state[m]["exp_avg_sq"].clone() for m in masters],
        "step": [float(state[m]["step"]) for m in masters],
        "scaler": engine.scaler.state_dict(),
        "lr": [group["lr"] for group in engine.optimizer.param_groups],
        "counters": (engine.global_steps, engine.micro_steps, engine.skipped_steps),
    }


def _assert_same(got: dict, expected: dict) -> None:
    for key in ("master", "exp_avg", "exp_avg_sq"):
        for a, b in zip(got[key], expected[key], strict=True):
            assert torch.equal(a, b), key
    assert {k: got[k] for k in ("step", "scaler", "lr", "counters")} == {
        k: expected[k] for k in ("step", "scaler", "lr", "counters")
    }


def _full_weights(engine) -> dict[str, torch.Tensor]:
    if engine.config.zero_optimization.stage == 3:  # only shards are kept between uses: gather them all
        for index in range(len(engine.states.units)):
            engine.states.gathering.gather(index)
    return {name: p.detach().float().clone() for name, p in engine.model.named_parameters()}


CASES = {
    "stage0-fp32-warmup": _config(0, scheduler=True),
    "stage0-fp16": _config(0, "fp16"),
    # fp32 without offload: the weight shards are their own master, loading writes into the weights.
    "stage1-fp32-naive-adam": {**_config(1), "zero_offload": {"cpu_adam": {"impl": "naive"}}},
    "stage2-bf16": _config(2, "bf16"),
    "stage2-offload-fp16-warmup": _config(2, "fp16", scheduler=True, offload_optimizer=CPU),
    "stage3-offload-all-fp16": _config(3, "fp16", offload_optimizer=CPU, offload_param=CPU),
    "stage2-partial-offload-fp16": _config(2, "fp16", offload_optimizer={**CPU, "ratio": 0.5}),
}


@pytest.mark.parametrize("case", CASES)
def test_save_load_continue_gives_the_same_losses_bit_for_bit(tmp_path, case):
    config = CASES[case]
    engine = _engine(config)
    _train(engine, range(SAVE_AT))
    rng = torch.get_rng_state()
    engine.save_checkpoint(tmp_path / "ckpt")
    at_save = _snapshot(engine)
    if config.get("fp16"):
        assert 0 < engine.skipped_steps < SAVE_AT, "the run must both skip and apply steps before the save"
    straight = _train(engine, range(SAVE_AT, STEPS))  # saving must not disturb the run either

    torch.rand(5)  # move the RNG on: loading must bring back the stream as it was at the save
    fresh = _engine(config, seed=1)
    fresh.load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(torch.get_rng_state(), rng)
    _assert_same(_snapshot(fresh), at_save)
    assert _train(fresh, range(SAVE_AT, STEPS)) == straight
    _assert_same(_snapshot(fresh), _snapshot(engine))


def _two_ranks(rank, world_size, directory):
    config = _config(2, scheduler=True, offload_optimizer=CPU)
    engine = _engine(config)
    _train(engine, range(SAVE_AT), rank, world_size)
    engine.save_checkpoint(directory)
    saved = _full_weights(engine)
    straight = _train(engine, range(SAVE_AT, STEPS), rank, world_size)
    fresh = _engine(config, seed=1)
    fresh.load_checkpoint(directory)
    resumed = _train(fresh, range(SAVE_AT, STEPS), rank, world_size)
    return {
        "saved": saved,
        "straight": straight,
        "resumed": resumed,
        "final": _full_weights(engine),
        "resumed_final": _full_weights(fresh),
    }


@pytest.mark.slow
def test_a_two_rank_checkpoint_resumes_at_two_ranks_exactly_and_at_one_rank_at_other_stages(tmp_path):
    ckpt = tmp_path / "ckpt"
    results = check(run_ranks(_two_ranks, 2, str(ckpt), timeout_s=120))
    assert sorted(os.listdir(ckpt)) == ["latest", "step00000003"]
    assert (ckpt / "latest").read_text() == "step00000003\n"
    assert sorted(os.listdir(ckpt / "step00000003")) == [
        "meta.json",
        "rank00000-of-00002.pt",
        "rank00001-of-00002.pt",
    ]
    for result in results:
        assert result["resumed"] == result["straight"]
        for name, weight in result["final"].items():
            assert torch.equal(result["resumed_final"][name], weight), name
    state = consolidate(ckpt)  # the two ranks' shards, put together
    for name, weight in results[0]["saved"].items():
        assert torch.equal(state[name], weight), name

    # One rank sees the whole batch the two ranks split: the same training, up to the order of the sums.
    expected = [(a + b) / 2 for a, b in zip(results[0]["straight"], results[1]["straight"], strict=True)]
    for config in (_config(0, scheduler=True), _config(3, scheduler=True)):
        engine = _engine(config, seed=1)
        engine.load_checkpoint(ckpt)
        assert engine.global_steps == SAVE_AT
        assert _train(engine, range(SAVE_AT, STEPS)) == pytest.approx(expected, rel=1e-6)
        assert max_rel(_full_weights(engine), results[0]["final"]) < 1e-6


NANO_TAG = "step00000002"


@pytest.fixture(scope="module")
def nano_checkpoint(tmp_path_factory):
    """A stage-0 fp32 checkpoint after two steps (its save is in folder NANO_TAG)."""
    engine = _engine(_config(0))
    _train(engine, range(2))
    path = tmp_path_factory.mktemp("nano") / "ckpt"
    engine.save_checkpoint(path)
    return path


def _copy(checkpoint, tmp_path):
    return shutil.copytree(checkpoint, tmp_path / "copy")


def test_to_fp32_writes_a_state_dict_the_plain_model_loads(tmp_path, capsys):
    # Stage 3 with offloaded weights: no rank ever holds the whole model, the consolidation must.
    engine = _engine(_config(3, offload_optimizer=CPU, offload_param=CPU))
    _train(engine, range(3))
    engine.save_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "weights.pt"
    assert main(["checkpoint", "to-fp32", str(tmp_path / "ckpt"), str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "(1 tied)" in printed and "weights_only=True" in printed

    state = torch.load(out, weights_only=True)
    plain = TinyGPT("nano", seed=1)
    assert list(state) == list(plain.state_dict())  # lm_head.weight too: the head is tied to the embedding
    assert all(t.dtype == torch.float32 for t in state.values())
    plain.load_state_dict(state)
    x, _ = BATCHES.global_batch(99, 2)
    with torch.no_grad():
        assert torch.equal(plain(x), engine(x))
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "weights.pt"]  # no temporary file left beside it


def test_to_fp32_says_what_is_wrong_with_the_directory(tmp_path, nano_checkpoint, capsys):
    out = tmp_path / "out.pt"
    assert main(["checkpoint", "to-fp32", str(tmp_path / "nowhere"), str(out)]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["checkpoint", "to-fp32", str(tmp_path / "empty"), str(out)]) == 2
    err = capsys.readouterr().err
    assert "is not a checkpoint" in err and str(tmp_path / "empty") in err
    unfinished = _copy(nano_checkpoint, tmp_path)
    (unfinished / NANO_TAG / "meta.json").unlink()
    assert main(["checkpoint", "to-fp32", str(unfinished), str(out)]) == 2
    assert "did not finish on every rank" in capsys.readouterr().err
    (unfinished / "latest").unlink()  # as the first save of a directory, killed, leaves it
    assert main(["checkpoint", "to-fp32", str(unfinished), str(out)]) == 2
    assert f"holds no complete checkpoint: {NANO_TAG} did not finish" in capsys.readouterr().err
    assert not out.exists()


def test_a_checkpoint_of_another_model_is_refused_naming_the_parameters(nano_checkpoint):
    path = nano_checkpoint
    shorter = _engine(_config(0), model=gpt_config("nano", seq_len=16))
    before = _snapshot(shorter)
    with pytest.raises(
        CheckpointError, match=r"wpe\.weight has shape \[32, 64\] in the checkpoint, \[16, 64\]"
    ):
        shorter.load_checkpoint(path)
    _assert_same(_snapshot(shorter), before)  # refused before anything was touched
    deeper = _engine(_config(2, offload_optimizer=CPU), model=gpt_config("nano", n_layer=3))
    with pytest.raises(
        CheckpointError, match=r"blocks\.2\.fc\.weight \[256, 64\] is in the model but not in"
    ):
        deeper.load_checkpoint(path)


def test_a_missing_or_foreign_rank_file_is_named(nano_checkpoint, tmp_path):
    copy = _copy(nano_checkpoint, tmp_path) / NANO_TAG
    meta = json.loads((copy / "meta.json").read_text())
    (copy / "meta.json").write_text(json.dumps({**meta, "global_steps": 7}))  # as if another save wrote it
    with pytest.raises(
        CheckpointError, match=r"rank00000-of-00001\.pt holds rank 0 of 1 at step 2.*two saves"
    ):
        _engine(_config(0)).load_checkpoint(copy)
    (copy / "rank00000-of-00001.pt").unlink()
    with pytest.raises(CheckpointError, match=r"1 rank file\(s\) are missing: rank00000-of-00001\.pt"):
        _engine(_config(0)).load_checkpoint(copy)


def test_a_failed_save_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    config = _config(2, "fp16", offload_optimizer=CPU)
    engine = _engine(config)
    real_save, calls = torch.save, []

    def disk_fills_up(obj, file, *args, **kwargs):
        calls.append(file)
        if len(calls) == 2:
            file.write(b"half a checkpoint")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_fills_up)
    _train(engine, range(3))
    engine.save_checkpoint(tmp_path / "ckpt")
    at_save = _snapshot(engine)
    _train(engine, range(3, 4))
    with pytest.raises(CheckpointError) as failure:
        engine.save_checkpoint(tmp_path / "ckpt")
    message = str(failure.value)
    assert str(tmp_path / "ckpt" / "step00000004" / "rank00000-of-00001.pt") in message
    assert "No space left on device" in message and "free some space" in message
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step00000003"]
    assert sorted(os.listdir(tmp_path / "ckpt" / "step00000003")) == ["meta.json", "rank00000-of-00001.pt"]
    monkeypatch.undo()
    fresh = _engine(config, seed=1)
    fresh.load_checkpoint(tmp_path / "ckpt")
    _assert_same(_snapshot(fresh), at_save)


def test_files_take_the_users_permissions_and_stay_in_the_directory(tmp_path):
    engine = _engine(_config(0))
    old = os.umask(0o027)
    try:
        engine.save_checkpoint(tmp_path / "ckpt")
    finally:
        os.umask(old)
    assert os.listdir(tmp_path) == ["ckpt"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step00000000"]
    for folder in (tmp_path / "ckpt", tmp_path / "ckpt" / "step00000000"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o750
    for file in [tmp_path / "ckpt" / "latest", *(tmp_path / "ckpt" / "step00000000").iterdir()]:
        assert stat.S_IMODE(file.stat().st_mode) == 0o640, file.name
        if file.suffix == ".pt":
            assert torch.load(file, weights_only=True)["format"] == FORMAT  # plain torch can read it safely
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointError, match=r"could not write .*a-file/ckpt.*Not a directory"):
        engine.save_checkpoint(tmp_path / "a-file" / "ckpt")


class _Payload:
    """Unpickling this opens (creates) a file: code a checkpoint from a stranger must never get to run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_rank_file_that_would_run_code_is_refused(nano_checkpoint, tmp_path, capsys):
    copy = _copy(nano_checkpoint, tmp_path)
    marker = tmp_path / "code-ran"
    rank_file = copy / NANO_TAG / "rank00000-of-00001.pt"
    torch.save({"format": FORMAT, "payload": _Payload(str(marker))}, rank_file)
    with pytest.raises(
        CheckpointError, match=r"refusing to load .*rank00000-of-00001\.pt.*Unsupported global: GLOBAL .*open"
    ):
        _engine(_config(0)).load_checkpoint(copy)
    with pytest.raises(CheckpointError, match="refusing to load"):
        consolidate(copy)
    assert main(["checkpoint", "to-fp32", str(copy), str(tmp_path / "out.pt")]) == 2
    assert "refusing to load" in capsys.readouterr().err
    with open(rank_file, "wb") as file:  # an old-style pickle, not a torch.save zip: never unpickled either
        pickle.dump({"payload": _Payload(str(marker))}, file)
    with pytest.raises(CheckpointError, match="not a file torch.save wrote"):
        consolidate(copy)
    assert not marker.exists()
    torch.save({"format": FORMAT, "payload": _Payload(str(marker))}, rank_file)
    torch.load(rank_file, weights_only=False)[
        "payload"
    ].close()  # the payload is live: it does run when allowed
    assert marker.exists()


def _with_extras(model: TinyGPT, value: float) -> TinyGPT:
    model.register_buffer("calibration", torch.full((3,), value))
    model.frozen = torch.nn.Parameter(torch.full((2,), value), requires_grad=False)
    return model


def test_buffers_and_frozen_weights_travel_with_the_checkpoint(tmp_path):
    config = _config(2, offload_optimizer=CPU)
    engine = zo.initialize(_with_extras(TinyGPT("nano"), 1.0), config, accelerator=EmulatedAccelerator())
    engine.save_checkpoint(tmp_path / "ckpt")
    fresh_model = _with_extras(TinyGPT("nano", seed=1), 2.0)
    zo.initialize(fresh_model, config, accelerator=EmulatedAccelerator()).load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(fresh_model.calibration, torch.ones(3)) and torch.equal(
        fresh_model.frozen, torch.ones(2)
    )
    state = consolidate(tmp_path / "ckpt")
    assert list(state) == list(fresh_model.state_dict())
    _with_extras(TinyGPT("nano", seed=1), 3.0).load_state_dict(state)


def test_saves_keep_the_newest_two_default_tags_and_never_a_users_folder(tmp_path):
    engine, path = _engine(_config(0)), tmp_path / "ckpt"
    (path / "notes").mkdir(parents=True)
    (path / "notes" / "meta.json").write_text("{}")  # a user's own folder, though it has a meta.json
    engine.save_checkpoint(path, tag="best")
    for step in range(3):
        _train(engine, range(step, step + 1))
        engine.save_checkpoint(path)
    assert sorted(os.listdir(path)) == ["best", "latest", "notes", "step00000002", "step00000003"]
    assert (path / "latest").read_text() == "step00000003\n"
    # A second save at the same step (a run's last save after its every-N one) goes beside it, never over it.
    engine.save_checkpoint(path)
    assert (path / "latest").read_text() == "step00000003-1\n"
    assert sorted(os.listdir(path)) == ["best", "latest", "notes", "step00000003", "step00000003-1"]
    with pytest.raises(CheckpointError, match=r"best already holds a complete checkpoint"):
        engine.save_checkpoint(path, tag="best")
    with pytest.raises(CheckpointError, match=r"tag '\.\./out' is not a plain folder name"):
        engine.save_checkpoint(path, tag="../out")
    (path / "notes" / "meta.json").unlink()
    (path / "notes" / "rank00000-of-00001.pt").write_bytes(b"")
    (path / "notes" / "todo.txt").write_text("")
    with pytest.raises(CheckpointError, match=r"notes exists and holds files that are not a checkpoint's"):
        engine.save_checkpoint(path, tag="notes")
    fresh = _engine(_config(0), seed=1)
    fresh.load_checkpoint(path)
    assert fresh.global_steps == 3
    fresh.load_checkpoint(path / "best")  # one save's folder loads by itself
    assert fresh.global_steps == 0


def test_a_checkpoint_written_before_tags_still_loads(tmp_path, nano_checkpoint):
    old = tmp_path / "old"  # rank files and meta.json right in the directory, no `latest`
    shutil.copytree(nano_checkpoint / NANO_TAG, old)
    fresh = _engine(_config(0), seed=1)
    fresh.load_checkpoint(old)
    assert fresh.global_steps == 2
    fresh.save_checkpoint(old)  # a new save beside it leaves its files alone; `latest` now decides
    assert sorted(os.listdir(old)) == ["latest", "meta.json", "rank00000-of-00001.pt", "step00000002"]
    assert consolidate(old).keys() == consolidate(nano_checkpoint).keys()
