"""Checkpoints that are damaged, edited by hand, cut short by a full disk, or attacked with a planted link.

Each one must stop with a CheckpointError that names the file and the field or tensor, never load quietly
wrong, and never harm a file the engine did not write.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch

import zero_offload as zo
from tests.support.corpus import fixed_corpus
from tests.support.training import BATCH, SEQ, make_config
from zero_offload import plots
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.cli import main
from zero_offload.implementation import checkpoint, checkpoint_format, durable
from zero_offload.implementation.checkpoint import CheckpointError, consolidate
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss

BATCHES = ByteBatches(fixed_corpus(), SEQ, seed=5)
RANK0 = "rank00000-of-00001.pt"
TAG = "step00000002"  # the folder of the save in `saved`


def _engine(stage=0, seed=0):
    return zo.initialize(TinyGPT("nano", seed=seed), make_config(stage), accelerator=EmulatedAccelerator())


def _train(engine, steps) -> None:
    for step in steps:
        x, y = BATCHES.micro_batch(step, BATCH)
        engine.backward(lm_loss(engine(x), y))
        engine.step()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    engine = _engine()
    _train(engine, range(2))
    path = tmp_path_factory.mktemp("integrity") / "ckpt"
    engine.save_checkpoint(path)
    return path


@pytest.fixture
def copy(saved, tmp_path):
    """A copy of the save's own folder: it loads as it is, as a checkpoint written before tags does."""
    return shutil.copytree(saved, tmp_path / "copy") / TAG


def _edit_meta(path, **fields) -> None:
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, **fields}))


def _rewrite(file, state) -> None:
    """Save `state` as a consistent rank file (its checksums recomputed), as a careful hand-editor would."""
    tensors = checkpoint_format.saved_tensors(state)
    state[checkpoint.CHECKSUMS] = {k: checkpoint_format.crc32(t) for k, t in tensors.items()}
    torch.save(state, file)


def test_four_flipped_bytes_in_a_tensor_are_found_on_load_and_in_to_fp32(copy, tmp_path, capsys):
    file = copy / RANK0
    master = torch.load(file, weights_only=True)["pieces"]["wte.weight"][0]["master"]
    raw = bytearray(file.read_bytes())
    at = raw.find(master.numpy().tobytes()[:64])  # tensors are stored uncompressed
    assert at > 0
    raw[at + 400 : at + 404] = bytes(b ^ 0xFF for b in raw[at + 400 : at + 404])
    file.write_bytes(bytes(raw))
    expected = rf"{file}: the tensor wte\.weight piece 0 master does not match its checksum.*damaged; resume from an earlier"
    with pytest.raises(CheckpointError, match=expected):
        _engine(seed=1).load_checkpoint(copy)
    out = tmp_path / "out.pt"
    assert main(["checkpoint", "to-fp32", str(copy), str(out)]) == 2
    assert "wte.weight piece 0 master does not match its checksum" in capsys.readouterr().err
    assert not out.exists()


def _split(copy, name: str, second_start):
    """A hand-merged 2-rank checkpoint: rank 1 holds the second half of `name`, said to start at
    `second_start` (None: rank 1 holds nothing of it); rank 0 holds everything else."""
    state = torch.load(copy / RANK0, weights_only=True)
    piece = state["pieces"][name][0]
    half = piece["master"].numel() // 2
    first = {"start": 0, **{k: piece[k][:half].clone() for k in checkpoint.STATES}}
    second = {"start": second_start, **{k: piece[k][half:].clone() for k in checkpoint.STATES}}
    ranks = [
        {**state, "world_size": 2, "pieces": {**state["pieces"], name: [first]}},
        {
            **state,
            "rank": 1,
            "world_size": 2,
            "extras": {},
            "pieces": {name: [second]} if second_start is not None else {},
        },
    ]
    (copy / RANK0).unlink()
    for rank, rank_state in enumerate(ranks):
        _rewrite(copy / checkpoint.rank_file(rank, 2), rank_state)
    _edit_meta(copy, world_size=2)
    return half


def test_overlapping_pieces_are_refused_though_their_sizes_add_up(copy):
    half = _split(copy, "blocks.0.fc.weight", second_start=0)  # should be `half`: elements half.. get none
    with pytest.raises(
        CheckpointError,
        match=rf"elements 0-{half - 1} of blocks\.0\.fc\.weight are in two pieces \(ranks 0 and 1\)",
    ):
        consolidate(copy)


def test_a_missing_piece_is_refused_naming_the_elements(copy):
    half = _split(copy, "blocks.0.fc.weight", second_start=None)
    with pytest.raises(
        CheckpointError, match=rf"elements {half}-{2 * half - 1} of blocks\.0\.fc\.weight are in no rank"
    ):
        _engine(seed=1).load_checkpoint(copy)


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("world_size", "abc", "field world_size is 'abc', expected a whole number of at least 1"),
        ("world_size", -1, "field world_size is -1, expected a whole number of at least 1"),
        ("world_size", True, "field world_size is True"),
        ("global_steps", 2.5, "field global_steps is 2.5"),
        ("stage", 7, "field stage is 7, expected a whole number from 0 to 3"),
    ],
)
def test_an_edited_meta_json_names_the_file_and_the_field(copy, tmp_path, capsys, field, value, expected):
    _edit_meta(copy, **{field: value})
    with pytest.raises(CheckpointError, match=rf"{copy / 'meta.json'}: {expected}"):
        _engine(seed=1).load_checkpoint(copy)
    assert main(["checkpoint", "to-fp32", str(copy), str(tmp_path / "out.pt")]) == 2
    assert expected in capsys.readouterr().err


def test_an_edited_piece_start_names_the_file_and_the_field(copy):
    state = torch.load(copy / RANK0, weights_only=True)
    state["pieces"]["wpe.weight"][0]["start"] = -5
    _rewrite(copy / RANK0, state)
    with pytest.raises(
        CheckpointError, match=rf"{copy / RANK0}: field pieces\['wpe\.weight'\]\[0\]\.start is -5, expected"
    ):
        consolidate(copy)
    state["pieces"]["wpe.weight"][0]["start"] = 0
    state["pieces"]["wpe.weight"][0]["exp_avg"] = torch.zeros(3)
    _rewrite(copy / RANK0, state)
    with pytest.raises(CheckpointError, match=r"field pieces\['wpe\.weight'\]\[0\]\.exp_avg is .* elements"):
        consolidate(copy)


def test_a_checkpoint_from_before_checksums_loads_with_a_warning(copy, saved):
    state = torch.load(copy / RANK0, weights_only=True)
    del state[checkpoint.CHECKSUMS]
    torch.save(state, copy / RANK0)
    with pytest.raises(CheckpointError, match=r"field crc32 does not list one checksum per tensor"):
        consolidate(copy)  # meta.json says the file has checksums: losing them is damage
    meta = json.loads((copy / "meta.json").read_text())
    del meta["checksums"]
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match=r"saved without checksums .* save it again to add them"):
        old = consolidate(copy)
    for key, tensor in consolidate(saved).items():
        assert torch.equal(old[key], tensor), key


class _FillsUp:
    """A file on a disk with `room` bytes left: the write that does not fit fails as the kernel's would."""

    def __init__(self, file, room):
        self.file, self.room = file, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)

    def flush(self):
        self.file.flush()


def _disk_fills_after(monkeypatch, saves_that_fit: int, room=600_000) -> None:
    real_save, calls = torch.save, []

    def save(obj, file, *args, **kwargs):
        calls.append(file)
        if len(calls) > saves_that_fit:
            file = _FillsUp(file, room)
        return real_save(obj, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def test_a_disk_that_fills_inside_torch_save_names_the_disk_the_size_and_the_last_checkpoint(
    tmp_path, monkeypatch
):
    engine = _engine()
    _train(engine, range(1))
    engine.save_checkpoint(tmp_path / "step_1")
    before = sorted(os.listdir(tmp_path / "step_1"))
    _disk_fills_after(monkeypatch, 0)  # torch.save's zip writer says "unexpected pos", not ENOSPC
    with pytest.raises(CheckpointError) as failure:
        engine.save_checkpoint(tmp_path / "step_2")
    message = str(failure.value)
    target = tmp_path / "step_2" / "step00000001" / RANK0
    assert f"could not write {target}: No space left on device: the disk at /" in message
    needed = 12 * engine.num_params / 1e6  # master, m and v in fp32
    assert f"needs about {needed:,.1f} MB in all" in message, message
    assert "free some space on that disk" in message
    assert f"The last good checkpoint is {tmp_path / 'step_1'} (step 1)." in message
    assert os.listdir(tmp_path / "step_2") == []  # the unfinished save is gone, its temporary file with it
    assert sorted(os.listdir(tmp_path / "step_1")) == before
    monkeypatch.undo()
    _engine(seed=1).load_checkpoint(tmp_path / "step_1")


def test_a_write_error_that_hides_its_cause_is_still_a_full_disk_when_too_little_is_free(
    tmp_path, monkeypatch
):
    engine = _engine()

    def fails(obj, file, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 591552 vs 591440")

    monkeypatch.setattr(torch, "save", fails)
    monkeypatch.setattr(
        checkpoint.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 4096)
    )
    with pytest.raises(CheckpointError, match=r"No space left on device: the disk at .* has 0\.0 MB free"):
        engine.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt").is_dir() and os.listdir(tmp_path / "ckpt") == []


def test_zo_train_stops_on_a_full_disk_with_one_line_naming_the_last_checkpoint(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: (plots.plt.close(fig), path)[1])
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_batch_size": 4, "zero_optimization": {"stage": 0}}))
    _disk_fills_after(monkeypatch, 1)  # the checkpoint after step 2 fits, the one after step 4 does not
    out = tmp_path / "out"
    args = ["train", "--config", str(config), "--model", "nano", "--steps", "6", "--out", str(out)]
    assert main([*args, "--save-every", "2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "No space left on device: the disk at" in errors[0], err
    assert f"The last good checkpoint is {out / 'checkpoints' / 'step_2'} (step 2)." in errors[0]


def test_a_link_planted_at_a_temporary_name_is_never_written_through_nor_removed(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "ckpt"
    path.mkdir()
    old_name = path / f".latest.{os.getpid()}.tmp"  # the name temporary files had before
    old_name.symlink_to(victim)
    engine = _engine()
    engine.save_checkpoint(path)
    assert victim.read_text() == "precious" and old_name.is_symlink()
    consolidate(path)

    # Even a name an attacker guesses is refused rather than followed: here every name is guessed.
    monkeypatch.setattr(durable, "temp_name", lambda final: final.with_name(f".{final.name}.guessed.tmp"))
    guessed = path / ".latest.guessed.tmp"
    guessed.symlink_to(victim)
    with pytest.raises(
        CheckpointError, match=rf"could not write {path / 'latest'}.*every temporary name tried was taken"
    ):
        engine.save_checkpoint(path, tag="again")
    assert victim.read_text() == "precious" and guessed.is_symlink()
    assert not (path / "again").exists()  # the save that could not be published is gone
    consolidate(path)  # the checkpoint saved before is whole
