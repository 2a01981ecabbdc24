"""A process killed (SIGKILL) in the middle of save_checkpoint leaves a directory that loads.

The kill is not timed: the k-th call the save makes to the file system (open, fsync, rename, unlink, mkdir,
rmdir) kills the process, for every k from the first call to the last, on one rank and on each of two. After
each kill the directory must load: the previous checkpoint, or the new one once its `latest` is in place, and
loading names the unfinished save it skipped. The saving processes are forked from this one, so that each
kill costs a fork rather than a fresh interpreter.
"""

from __future__ import annotations

import datetime
import itertools
import os
import shutil
import signal
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist

import zero_offload as zo
from tests.support.corpus import fixed_corpus
from tests.support.distributed import free_port
from tests.support.training import BATCH, SEQ, make_config
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.implementation.checkpoint_tags import default_tag
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the saving processes are forked")

BATCHES = ByteBatches(fixed_corpus(), SEQ, seed=5)
FILE_CALLS = ("open", "fsync", "replace", "rename", "unlink", "mkdir", "rmdir")
GUARD_S = 120  # a process still running after this is hung: the test fails instead of waiting forever


def _engine(seed=0):
    return zo.initialize(TinyGPT("nano", seed=seed), make_config(0), accelerator=EmulatedAccelerator())


def _train(engine, steps, rank=0, world_size=1) -> None:
    for step in steps:
        x, y = BATCHES.micro_batch(step, BATCH // world_size, rank=rank, world_size=world_size)
        engine.backward(lm_loss(engine(x), y))
        engine.step()


def _kill_at(k: int) -> None:
    """From now on, the k-th call to the file system kills this process, as `kill -9` would."""
    calls = itertools.count(1)

    def counted(real):
        def call(*args, **kwargs):
            if next(calls) == k:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        return call

    for name in FILE_CALLS:
        setattr(os, name, counted(getattr(os, name)))  # in the forked process only


def _fork(fn, *args) -> int:
    """Run fn(*args) in a forked process; it exits 0 if fn returned, 1 if it raised."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn(*args)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def _wait(pid: int) -> int:
    """The exit code of process `pid` (-9: killed), failing the test if it is still running after GUARD_S."""
    deadline = time.monotonic() + GUARD_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"process {pid} hung")
        time.sleep(0.01)


def _loads(path, step: int) -> str:
    """The directory loads: the save at `step` if `latest` names it, else the one before, which is whole, and
    loading names an unfinished save it skipped. Returns the tag loaded."""
    old, new = default_tag(step - 1), default_tag(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = _engine(seed=1)
        engine.load_checkpoint(path)
    published = (path / "latest").read_text() == f"{new}\n"
    assert engine.global_steps == (step if published else step - 1)
    new = path / new
    unfinished = new.is_dir() and any(new.iterdir()) and not (new / "meta.json").is_file()
    skipped = [str(w.message) for w in caught if "did not finish" in str(w.message)]
    assert len(skipped) == unfinished, skipped
    if unfinished:
        assert f"skipped {new.name}, a save that did not finish" in skipped[0]
        assert f"loading {old}" in skipped[0]
    return new.name if published else old


def _kill_saving(path, engine, k: int) -> None:
    _kill_at(k)
    engine.save_checkpoint(path)


def test_one_rank_killed_at_every_file_call_of_a_save_leaves_a_checkpoint_that_loads(tmp_path):
    engine = _engine()
    for step in (1, 2):  # two saves in place: once `latest` moves on, the older one goes
        _train(engine, range(step - 1, step))
        engine.save_checkpoint(tmp_path / "template")
    _train(engine, range(2, 3))
    outcomes = []
    for k in itertools.count(1):
        path = shutil.copytree(tmp_path / "template", tmp_path / f"killed-at-{k}")
        code = _wait(_fork(_kill_saving, path, engine, k))
        assert code in (0, -signal.SIGKILL), f"the save raised, killed at call {k}"
        if code == 0:  # the save made fewer than k calls: every one of them has been tried
            break
        outcomes.append(_loads(path, 3))
    # Killed in every phase: before the new save was complete, and after `latest` named it (in the retention).
    assert outcomes.count(default_tag(2)) >= 8 and outcomes.count(default_tag(3)) >= 2, outcomes
    _loads(path, 3)  # the save that was not killed
    assert sorted(os.listdir(path)) == ["latest", default_tag(2), default_tag(3)]


def _two_ranks(rank: int, port: int, path, victim: int, k: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=30),
    )
    engine = _engine()
    _train(engine, range(1), rank, 2)
    engine.save_checkpoint(path)
    _train(engine, range(1, 2), rank, 2)
    if rank == victim:
        _kill_at(k)
    engine.save_checkpoint(path)


@pytest.mark.parametrize("victim", [0, 1])
def test_one_of_two_ranks_killed_at_every_file_call_of_a_save_leaves_one_that_loads(tmp_path, victim):
    for k in itertools.count(1):
        path = tmp_path / f"killed-at-{k}"
        port = free_port()
        pids = [_fork(_two_ranks, rank, port, path, victim, k) for rank in range(2)]
        codes = [_wait(pid) for pid in pids]  # the survivor stops by itself: its next collective fails
        if codes == [0, 0]:  # the victim's save made fewer than k calls: every one has been tried
            break
        assert codes[victim] == -signal.SIGKILL, codes
        _loads(path, 2)
    assert k > 4
    _loads(path, 2)
