"""The NVMe tier (practice/nvme.py): the same training as the CPU tier, bit for bit, with the fp32 optimizer
states in files and only `buffer_count` sub-groups of them in host memory; failures leave the files whole.

Every run uses a sub_group_size that cuts the nano GPT's partition into several sub-groups, and 2 slots, so
reads ahead, writes behind and slot reuse all happen.
"""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch

import zero_offload as zo
from tests.support.corpus import fixed_corpus
from tests.support.distributed import check, run_ranks
from tests.support.training import BATCH, SEQ, make_config, train_run
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.practice import nvme, nvme_files
from zero_offload.practice.nvme import NVMeError, NVMeStates, SwapFiles
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss

STEPS = 3
SUB_GROUP = 20_000  # the nano GPT's 15 units (118,528 parameters) make 7 sub-groups on one rank, 4 on two


def _config(tier, stage=2, precision="fp32", path=None, impl="simd", **zero):
    offload = {"device": "cpu"}
    if tier == "nvme":
        offload = {"device": "nvme", "nvme_path": str(path), "buffer_count": 2}
    config = make_config(stage, precision, offload_optimizer=offload, sub_group_size=SUB_GROUP, **zero)
    config["zero_offload"] = {"cpu_adam": {"impl": impl}}
    return config


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _pairs(rank, world_size, path, cases):
    """Final weights of the NVMe tier and of the CPU tier, for each (stage, precision, CPU Adam, zero extras)."""
    out = []
    for case, (stage, precision, impl, zero) in enumerate(cases):
        swap = f"{path}/case{case}"  # each engine its own: train_run leaves its engine open
        nvme_run = train_run(rank, world_size, _config("nvme", stage, precision, swap, impl, **zero), STEPS)
        cpu_run = train_run(rank, world_size, _config("cpu", stage, precision, None, impl, **zero), STEPS)
        out.append((nvme_run["weights"], cpu_run["weights"], nvme_run["skipped"]))
    return out


def _check(cases, pairs):
    for case, (ours, theirs, skipped) in zip(cases, pairs, strict=True):
        assert skipped == 0 and _same(ours, theirs), case


@pytest.mark.parametrize("impl, stages", [("simd", (2, 3)), ("torch", (1, 3))])
def test_the_nvme_tier_trains_bit_for_bit_like_the_cpu_tier_on_one_rank(tmp_path, impl, stages):
    cases = [(stage, "fp32", impl, {}) for stage in stages]
    _check(cases, _pairs(0, 1, tmp_path, cases))


def test_the_nvme_tier_trains_bit_for_bit_like_the_cpu_tier_on_two_ranks(tmp_path):
    cases = [(2, "fp32", "simd", {}), (3, "fp32", "torch", {"offload_param": {"device": "cpu"}})]
    for rank_pairs in check(run_ranks(_pairs, 2, str(tmp_path), cases)):
        _check(cases, rank_pairs)


def test_fp16_on_the_nvme_tier_matches_the_cpu_tier_too(tmp_path):
    """The one-pass C Adam rounds into the staging buffers, torch's Adam is followed by a cast: both exact."""
    cases = [(2, "fp16", "simd", {}), (3, "fp16", "torch", {"offload_param": {"device": "cpu"}})]
    _check(cases, _pairs(0, 1, tmp_path, cases))


def test_a_slot_is_reused_only_after_its_write_has_finished(tmp_path, monkeypatch):
    """Slow writes must hold back the reads into their slots; a read that does not wait corrupts the files."""
    write = SwapFiles.write

    def slow_write(self, group, state, data):
        if state == "master":
            time.sleep(0.02)
        return write(self, group, state, data)

    monkeypatch.setattr(SwapFiles, "write", slow_write)
    reference = train_run(0, 1, _config("cpu"), 2)["weights"]
    assert _same(train_run(0, 1, _config("nvme", path=tmp_path), 2)["weights"], reference)
    # The wrong version: read ahead into a slot without waiting for its write.
    monkeypatch.setattr(NVMeStates, "_read_after", lambda self, g, pending: nvme._timed(self._read_group, g))
    assert not _same(train_run(0, 1, _config("nvme", path=tmp_path / "b"), 2)["weights"], reference)


# -- engines driven step by step -------------------------------------------------------------------------------
BATCHES = ByteBatches(fixed_corpus(), SEQ, seed=11)


def _engine(config):
    return zo.initialize(TinyGPT("nano", seed=0), config, accelerator=EmulatedAccelerator())


def _train(engine, steps):
    for _ in range(steps):
        x, y = BATCHES.micro_batch(engine.global_steps, BATCH)
        engine.backward(lm_loss(engine(x), y))
        engine.step()


def _weights(engine):
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def _optimizer_states(engine):
    """Every unit's master weights, m and v: read from the files on the NVMe tier."""
    states, out = engine.states, []
    indices = states.each_unit() if isinstance(states, NVMeStates) else range(len(states.master_params))
    for index in indices:
        master = states.master_params[index]
        state = engine.optimizer.state[master]
        out.append([t.clone() for t in (master, state["exp_avg"], state["exp_avg_sq"])])
    return out


def test_the_states_live_in_files_and_the_host_keeps_only_buffer_count_slots(tmp_path):
    rank_dir = tmp_path / "zero_offload_rank0"
    rank_dir.mkdir()
    stale = ["subgroup00099.master", ".subgroup00000.master.123.tmp"]  # an earlier run's leftovers
    for name in stale:
        (rank_dir / name).write_bytes(b"old")
    with pytest.warns(UserWarning, match=r"holds 2 file\(s\) this engine did not create.*left alone"):
        engine = _engine(_config("nvme", precision="fp16", path=tmp_path))
    _train(engine, 1)
    states = engine.states
    groups, slot = states.groups, states.swap.slot_numel
    sizes = [u.shard_numel for u in states.units]
    assert len(groups) >= 4 and states.swap.slots == 2
    assert slot == max(sum(sizes[i] for i in g) for g in groups) < sum(sizes) / 3
    for buffer in (states.master, states.exp_avg, states.exp_avg_sq):
        assert buffer.numel() == 2 * slot
    # Every master partition and moment is a view of a slot, not a buffer of its own.
    for views, flat in ((states.master_params, states.master), (states.exp_avgs, states.exp_avg)):
        assert all(v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for v in views)
    files = sorted(p.name for p in rank_dir.iterdir())
    ours = [f"subgroup{g:05d}.{s}" for g in range(len(groups)) for s in nvme.STATES]
    assert files == sorted(ours + stale)  # the engine deletes only what it created
    for g, group in enumerate(groups):
        assert (rank_dir / f"subgroup{g:05d}.exp_avg").stat().st_size == 4 * sum(sizes[i] for i in group)
    report = engine.memory_report()
    assert report.measured.nvme == 12 * sum(sizes) == report.estimated.nvme
    for state in ("master_weights", "exp_avg", "exp_avg_sq"):
        assert report.measured.bytes[state]["host"] == 4 * 2 * slot
    cpu = _engine(_config("cpu", precision="fp16")).memory_report()
    assert cpu.measured.host - report.measured.host == 12 * (sum(sizes) - 2 * slot)
    stages = {span.stage for span in engine.timeline()[0]}
    assert {"NVMe read", "NVMe write", "Adam"} <= stages


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_an_unwritable_nvme_path_is_refused_at_initialize(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(NVMeError, match=r"Permission denied \(EACCES\).*writable.*nvme_path"):
            _engine(_config("nvme", path=tmp_path / "swap"))
    finally:
        tmp_path.chmod(0o700)


def test_an_nvme_path_that_is_a_file_or_a_full_drive_is_refused_at_initialize(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(NVMeError, match=r"file/zero_offload_rank0: Not a directory \(ENOTDIR\)"):
        _engine(_config("nvme", path=tmp_path / "file"))
    usage = nvme_files.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(nvme_files.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(NVMeError, match=r"needs 2,844,672 bytes .* and 1,000 bytes .* are free"):
        _engine(_config("nvme", path=tmp_path / "swap"))


def test_a_full_drive_at_a_step_raises_there_and_the_files_keep_the_last_good_step(tmp_path, monkeypatch):
    cpu, ours = _engine(_config("cpu")), _engine(_config("nvme", path=tmp_path))
    _train(cpu, 2)
    _train(ours, 2)
    files, calls = ours.states.files, []

    def full_at_the_third_write(group, state, data):
        calls.append(group)
        if len(calls) == 2 * 3 + 1:  # the third sub-group's master: two sub-groups are written by then
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(files.path(group, state)))
        return SwapFiles.write(files, group, state, data)

    monkeypatch.setattr(files, "write", full_at_the_third_write)
    with pytest.raises(NVMeError, match=r"No space left on device \(ENOSPC\); free space"):
        _train(ours, 1)
    # The files, the device weights and the counts all hold step 2; no temporary file is left behind.
    assert ours.global_steps == 2 and ours.optimizer.state[ours.states.master_params[0]]["step"] == 2
    assert _same(_weights(ours), _weights(cpu))
    for mine, theirs in zip(_optimizer_states(ours), _optimizer_states(cpu), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    assert not [p for p in files.dir.iterdir() if p.name.endswith(".tmp")]
    # With space again, the step is taken again and training goes on as if nothing had happened.
    monkeypatch.undo()
    ours.zero_grad()
    _train(ours, 2)
    _train(cpu, 2)
    assert _same(_weights(ours), _weights(cpu))


def test_checkpoints_move_between_the_nvme_and_the_cpu_tier(tmp_path):
    reference = _engine(_config("cpu"))
    nvme_engine = _engine(_config("nvme", path=tmp_path / "swap"))
    _train(reference, 2)
    _train(nvme_engine, 2)
    reference.save_checkpoint(tmp_path / "from_cpu")
    nvme_engine.save_checkpoint(tmp_path / "from_nvme")
    to_cpu, to_nvme = _engine(_config("cpu")), _engine(_config("nvme", path=tmp_path / "swap2"))
    to_cpu.load_checkpoint(tmp_path / "from_nvme")
    to_nvme.load_checkpoint(tmp_path / "from_cpu")
    for engine in (reference, to_cpu, to_nvme):
        _train(engine, 1)
    assert _same(_weights(to_cpu), _weights(reference))
    assert _same(_weights(to_nvme), _weights(reference))


@pytest.mark.parametrize(
    "zero, message",
    [
        (
            {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"}},
            'parameters on NVMe are not supported.*"device": "cpu"',
        ),
        ({"stage": 2, "offload_optimizer": {"device": "nvme", "ratio": 0.5}}, "keep ratio 1.0"),
    ],
)
def test_what_the_nvme_tier_does_not_do_is_refused_with_the_fix(tmp_path, zero, message):
    for section in ("offload_optimizer", "offload_param"):
        if zero.get(section, {}).get("device") == "nvme":
            zero[section]["nvme_path"] = str(tmp_path)
    config = make_config(**zero)
    with pytest.raises(NotImplementedError, match=message):
        _engine(config)
