"""The NVMe tier's files are its own (practice/nvme_files.py, nvme_lock.py): one job per swap directory, a file
changed underneath is caught on read, and nothing outside what the engine created is written or deleted."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys

import pytest

from tests.modules.test_nvme import _config, _engine, _train
from zero_offload.cli import main
from zero_offload.practice import nvme_files
from zero_offload.practice.nvme import NVMeError, NVMePathError


def test_a_second_engine_on_the_same_nvme_path_is_refused_until_the_first_is_closed(tmp_path):
    first = _engine(_config("nvme", path=tmp_path))
    _train(first, 1)
    with pytest.raises(NVMePathError, match=rf"in use: another engine of this process \(pid {os.getpid()}\).*"
                       r"engine\.close\(\).*give this job another .*nvme_path"):  # fmt: skip
        _engine(_config("nvme", path=tmp_path))
    _train(first, 1)  # the refused engine touched none of the first one's files
    first.close()
    assert not (tmp_path / "zero_offload_rank0").exists()  # its files, and the directory it made, are gone
    second = _engine(_config("nvme", path=tmp_path))
    _train(second, 1)
    second.close()
    assert list(tmp_path.iterdir()) == []  # the lock file too


def test_a_live_owner_is_named_and_a_dead_ones_lock_is_taken_over(tmp_path):
    holder = (
        "import sys, time; from zero_offload.practice.nvme_lock import SwapLock; "
        "SwapLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(600)"
    )
    lock = tmp_path / "zero_offload_rank0.lock"
    other = subprocess.Popen([sys.executable, "-c", holder, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "locked"
        with pytest.raises(NVMePathError, match=rf"process {other.pid} on .*, command: .*-c import sys"):
            _engine(_config("nvme", path=tmp_path))
    finally:
        other.kill()  # SIGKILL: no chance to clean up, the lock file stays behind
        other.wait()
    assert lock.read_text().split()[0] == str(other.pid)
    engine = _engine(_config("nvme", path=tmp_path))
    assert lock.read_text().split()[0] == str(os.getpid())
    _train(engine, 1)
    engine.close()


def _poke(path, value=float("inf")):
    with open(path, "r+b") as file:
        file.seek(4 * 10)
        file.write(struct.pack("<f", value))


def test_a_swap_file_changed_underneath_raises_naming_it_instead_of_training_on_it(tmp_path):
    engine = _engine(_config("nvme", path=tmp_path))
    _train(engine, 1)
    damaged = engine.states.files.path(1, "master")
    _poke(damaged)
    with pytest.raises(NVMeError, match=rf"{damaged} does not hold what this process wrote .*CRC-32.*"
                       r"modified or damaged.*resume from the last checkpoint, and check the drive"):  # fmt: skip
        _train(engine, 1)
    assert engine.global_steps == 1
    engine.close()


def test_a_swap_file_cut_short_or_grown_raises_too(tmp_path):
    engine = _engine(_config("nvme", path=tmp_path))
    _train(engine, 1)
    files = engine.states.files
    with open(files.path(0, "exp_avg"), "ab") as file:
        file.write(b"\0" * 4)
    with pytest.raises(NVMeError, match=r"subgroup00000.exp_avg holds [\d,]+ bytes, [\d,]+ were expected"):
        list(engine.states.each_unit())  # what a checkpoint reads
    engine.close()


def test_a_symlinked_rank_directory_is_refused_and_its_target_left_alone(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    for name in ("subgroup00099.master", "notes.txt"):
        (target / name).write_text("keep me")
    (tmp_path / "swap").mkdir()
    (tmp_path / "swap" / "zero_offload_rank0").symlink_to(target)
    with pytest.raises(NVMePathError, match=r"zero_offload_rank0 is a symbolic link.*point .*nvme_path at"):
        _engine(_config("nvme", path=tmp_path / "swap"))
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt", "subgroup00099.master"]
    assert not (tmp_path / "swap" / "zero_offload_rank0.lock").exists()


def test_a_symlink_in_place_of_the_lock_file_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "swap").mkdir()
    (tmp_path / "swap" / "zero_offload_rank0.lock").symlink_to(victim)
    with pytest.raises(NVMePathError, match=r"rank0\.lock: .*\(ELOOP\); a symbolic link stands where"):
        _engine(_config("nvme", path=tmp_path / "swap"))
    assert victim.read_text() == "keep me"


def test_close_removes_what_the_engine_created_and_nothing_else(tmp_path):
    rank_dir = tmp_path / "zero_offload_rank0"
    rank_dir.mkdir()
    theirs = ["subgroup00099.master", ".subgroup00000.master.1.tmp", "README"]
    for name in theirs:
        (rank_dir / name).write_text("not the engine's")
    with pytest.warns(UserWarning, match=r"2 file\(s\) this engine did not create"):
        engine = _engine(_config("nvme", path=tmp_path))
    _train(engine, 2)
    engine.close()
    assert sorted(p.name for p in rank_dir.iterdir()) == sorted(theirs)  # the directory was not its to remove
    assert all(p.read_text() == "not the engine's" for p in rank_dir.iterdir())


@pytest.mark.parametrize("fault", ["a file", "a full drive"])
def test_zo_train_prints_an_unusable_nvme_path_as_one_line(tmp_path, capsys, monkeypatch, fault):
    swap, expected = tmp_path / "swap", r"error: not enough free space for the NVMe tier in .*choose another"
    if fault == "a file":
        swap.write_text("not a directory")
        expected = r"error: could not create the swap directory .*\(ENOTDIR\); nvme_path must be a directory"
    else:
        usage = nvme_files.shutil.disk_usage(tmp_path)
        monkeypatch.setattr(nvme_files.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    (tmp_path / "config.json").write_text(json.dumps(_config("nvme", path=swap)))
    code = main(["train", "--config", str(tmp_path / "config.json"), "--model", "nano", "--steps", "1",
                 "--out", str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and re.match(expected, err[0]), err
