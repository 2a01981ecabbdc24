"""Checkpoints that outlive the run that wrote them: any world size or ZeRO stage can load them.

A checkpoint is a directory:

  rank00000-of-00002.pt   one file per rank: its pieces of the fp32 master weights and of Adam's m and v,
  rank00001-of-00002.pt   each labelled with the parameter's name and where it starts in the flattened
                          parameter; and what it takes to resume: steps, Adam's step count, loss scale,
                          lr schedule, RNG states
  meta.json               a readable summary, written by rank 0 last, once every rank's file is in place

Pieces are stored by parameter name, not by shard, because a shard is an accident of the run: stage 0 keeps
one flat buffer, stages 1-3 cut each module's buffer into world-size shards with padding. Loading puts the
pieces back together into whole parameters and cuts them again for the engine that loads. The files hold only
tensors and plain Python values, so they load with `torch.load(weights_only=True)`: a checkpoint from someone
else cannot run code.

Every tensor is saved with its CRC-32 and checked on loading, as are the pieces (each element of each parameter
in exactly one): a damaged or hand-edited checkpoint is refused, naming the file and the tensor or field,
instead of loading wrong weights.
"""

from __future__ import annotations

import datetime
import errno
import json
import math
import os
import pickle
import re
import shutil
import warnings
import zipfile
import zlib
from pathlib import Path

import torch

from .durable import CheckpointError, fsync_dir, mount_point, os_error_behind, write_error, write_temp

FORMAT = "zero_offload.checkpoint/1"
META = "meta.json"
STATES = ("master", "exp_avg", "exp_avg_sq")
CHECKSUMS = "crc32"
_RANK_FILE = re.compile(r"rank(\d{5})-of-(\d{5})\.pt")


def rank_file(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.pt"


# -- what a rank holds ---------------------------------------------------------------------------------------
def _param_names(model: torch.nn.Module) -> dict[int, str]:
    """id(param) -> the name it is saved under; a tied weight keeps the first, as named_parameters() does."""
    return {id(p): name for name, p in model.named_parameters() if p.requires_grad}


def _pieces(engine) -> list[tuple[str, int, int, int, int]]:
    """(name, start, numel, index, offset): elements [start, start + numel) of flattened parameter `name`
    are elements [offset, offset + numel) of this rank's master_params[index] and of its m and v."""
    states, names = engine.states, _param_names(engine.model)
    if engine.config.zero_optimization.stage == 0:  # one flat buffer over all parameters, in order
        offsets = [0]
        for param in states.params:
            offsets.append(offsets[-1] + param.numel())
        return [(names[id(p)], 0, p.numel(), 0, offsets[i]) for i, p in enumerate(states.params)]
    return [
        (names[id(unit.params[s.param])], s.param_start, s.numel, index, s.shard_start)
        for index, unit in enumerate(states.units)
        for s in unit.layout.slices
    ]


def _optimizer_tensors(engine, index: int) -> dict[str, torch.Tensor]:
    """master_params[index] and its moments, as the optimizer holds them (its own buffers, not copies)."""
    master = engine.states.master_params[index]
    state = engine.optimizer.state[master]
    return {"master": master, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}


def _units(engine, *, write: bool = False):
    """(index, tensors, pieces) for every master partition, in order: its _optimizer_tensors and its pieces
    (name, start, numel, offset). On the NVMe tier (practice/nvme.py) the tensors are valid only until
    the next index: they pass through host memory a sub-group at a time, read from the files, or with `write`
    written back to them after the caller has filled them."""
    pieces: dict[int, list] = {}
    for name, start, numel, index, offset in _pieces(engine):
        pieces.setdefault(index, []).append((name, start, numel, offset))
    each_unit = getattr(engine.states, "each_unit", None)
    indices = each_unit(write=write) if each_unit else range(len(engine.states.master_params))
    for index in indices:
        yield index, _optimizer_tensors(engine, index), pieces.get(index, [])


def _model_entries(model: torch.nn.Module) -> dict[str, str | torch.Tensor]:
    """The model's state_dict, in its order: for a trainable parameter, the name it is saved under (a tied
    weight has an entry per key); for anything else (buffers, frozen parameters), the tensor itself."""
    names = _param_names(model)
    return {key: names.get(id(tensor), tensor) for key, tensor in model.state_dict(keep_vars=True).items()}


def _rank_state(engine) -> dict:
    """Everything this rank writes: plain Python values and CPU tensors only."""
    comm, model, stage = engine.comm, engine.model, engine.config.zero_optimization.stage
    pieces: dict[str, list[dict]] = {}
    # Stage 0 ranks hold identical replicas: rank 0's copy is enough.
    if stage > 0 or comm.rank == 0:
        for _, tensors, unit_pieces in _units(engine):
            for name, start, numel, offset in unit_pieces:
                piece = {"start": start}
                for key in STATES:
                    # A copy of just the piece: saving a view would write its whole storage (the flat buffer).
                    piece[key] = tensors[key][offset : offset + numel].detach().to("cpu", copy=True)
                pieces.setdefault(name, []).append(piece)
    entries = _model_entries(model)
    # Buffers and frozen weights are the same on every rank (data parallelism): rank 0 saves them.
    others = {k: t for k, t in entries.items() if not isinstance(t, str)} if comm.rank == 0 else {}
    scheduler = engine.lr_scheduler
    state = {
        "format": FORMAT,
        "rank": comm.rank,
        "world_size": comm.world_size,
        "stage": stage,
        "precision": engine.config.precision,
        "fingerprint": engine.config.fingerprint(),
        "config": engine.config.to_dict(),
        "params": {name: list(p.shape) for name, p in model.named_parameters() if p.requires_grad},
        "state_dict_keys": list(entries),
        "aliases": {key: name for key, name in entries.items() if isinstance(name, str)},
        "extras": {key: tensor.detach().to("cpu", copy=True) for key, tensor in others.items()},
        "pieces": pieces,
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        # Every step updates every master tensor, so they all share one count.
        "optimizer_step": float(engine.optimizer.state[engine.states.master_params[0]]["step"]),
        "scaler": {"kind": type(engine.scaler).__name__, "state": engine.scaler.state_dict()},
        "lr_scheduler": None if scheduler is None else scheduler.state_dict(),
        "rng": {
            "cpu": torch.get_rng_state(),
            # Only if CUDA was used: asking an unused CUDA for its state would create a context for nothing.
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
        },
    }
    state[CHECKSUMS] = {label: _crc32(tensor) for label, tensor in _tensors(state).items()}
    return state


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a rank file, by the label its checksum is stored under and an error names it by."""
    found = {
        f"{name} piece {i} {key}": piece[key]
        for name, pieces in state["pieces"].items()
        for i, piece in enumerate(pieces)
        for key in STATES
    }
    found.update({f"buffer {key}": tensor for key, tensor in state["extras"].items()})
    found.update({f"rng {key}": t for key, t in state["rng"].items() if isinstance(t, torch.Tensor)})
    return found


def _crc32(tensor: torch.Tensor) -> int:
    # CRC-32: 2.8 GB/s on one core here (blake2b 0.5, adler32 1.7), so the 200 MB of a 16.7M-parameter
    # model's states cost ~70 ms; it finds damage, not a forger, who could recompute it.
    return zlib.crc32(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _meta(engine, state: dict) -> dict:
    return {
        "format": FORMAT,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "world_size": state["world_size"],
        "stage": state["stage"],
        "precision": state["precision"],
        "fingerprint": state["fingerprint"],
        "num_parameters": sum(math.prod(shape) for shape in state["params"].values()),
        "global_steps": state["global_steps"],
        "micro_steps": state["micro_steps"],
        "skipped_steps": state["skipped_steps"],
        "optimizer_step": state["optimizer_step"],
        "loss_scale": engine.scaler.scale,
        "lr": [group["lr"] for group in engine.optimizer.param_groups],
        "files": [rank_file(r, state["world_size"]) for r in range(state["world_size"])],
        "checksums": CHECKSUMS,  # every rank file has one per tensor; older checkpoints have none
        "config": state["config"],
    }


# -- writing -------------------------------------------------------------------------------------------------
def _megabytes(nbytes: int) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


def _last_good(engine, path: Path) -> str:
    """Where the run can go back to: the engine's last checkpoint, or one already in `path`, if complete."""
    last = getattr(getattr(engine, "skip_guard", None), "last_checkpoint", None)
    if last is not None and (Path(last[0]) / META).is_file():
        return f"The last good checkpoint is {last[0]} (step {last[1]})."
    if (path / META).is_file():
        return f"The last good checkpoint is the one already in {path}."
    return "No earlier checkpoint is known to this run."


def _save_error(engine, final: Path, state: dict, err: Exception, outcome: str) -> Exception:
    """The CheckpointError for a rank file that could not be written: a full disk names the disk, the bytes
    the checkpoint needs and the last good checkpoint. Anything that is no write failure passes unchanged."""
    found = os_error_behind(err)
    directory = next((d for d in (final.parent, *final.parents) if d.is_dir()), final.parent)
    free = shutil.disk_usage(directory).free  # after the temporary file is gone: what the save had to use
    mine = sum(t.numel() * t.element_size() for t in _tensors(state).values())
    extras = sum(t.numel() * t.element_size() for t in state["extras"].values())
    needed = len(STATES) * 4 * sum(math.prod(shape) for shape in state["params"].values()) + extras
    full = found is not None and found.errno in (errno.ENOSPC, errno.EDQUOT)
    if full or (found is None and free < mine):
        return CheckpointError(
            f"could not write {final}: {os.strerror(errno.ENOSPC)}: the disk at {mount_point(directory)} has "
            f"{_megabytes(free)} free, and the checkpoint needs about {_megabytes(needed)} in all "
            f"({_megabytes(mine)} for this rank's file); free some space on that disk or save to another "
            f"directory. {outcome} {_last_good(engine, final.parent)}"
        )
    return err if found is None else write_error(final, found, outcome)


def _elsewhere(outcome: str = "") -> CheckpointError:
    return CheckpointError(
        f"another rank could not write its part of the checkpoint; see that rank's error. {outcome}".strip()
    )


def save_checkpoint(engine, path) -> None:
    """Every rank writes its file into directory `path`; rank 0 adds meta.json once all are in place.

    Two phases, so that a failure anywhere (a full disk) leaves a previous checkpoint in `path` whole: every
    rank first writes a temporary file; only when all have succeeded does each rename its file into place.
    """
    path, comm = Path(path), engine.comm
    state = _rank_state(engine)
    final = path / rank_file(comm.rank, comm.world_size)
    temp, error = None, None
    kept = f"Any previous checkpoint in {path} is left as it was."
    try:
        path.mkdir(parents=True, exist_ok=True)
        temp = write_temp(final, lambda file: torch.save(state, file))
    except Exception as err:  # raised below on every rank, never here alone
        error = _save_error(engine, final, state, err, kept)
    try:
        comm.raise_together(error, _elsewhere(f"{kept} {_last_good(engine, path)}"))
    except Exception:
        if temp is not None:
            temp.unlink(missing_ok=True)
        raise
    try:
        os.replace(temp, final)
        fsync_dir(path)
    except OSError as err:
        temp.unlink(missing_ok=True)
        error = write_error(final, err, "The checkpoint in that directory may now mix two saves.")
    comm.raise_together(error, _elsewhere())
    if comm.rank == 0:
        try:
            # Rank files that an earlier save by another world size left here belong to no checkpoint now.
            for old in path.iterdir():
                match = _RANK_FILE.fullmatch(old.name)
                if match and int(match.group(2)) != comm.world_size:
                    old.unlink()
            meta = json.dumps(_meta(engine, state), indent=2) + "\n"
            os.replace(write_temp(path / META, lambda file: file.write(meta.encode())), path / META)
            fsync_dir(path)
        except OSError as err:
            error = write_error(
                path / META, err, f"The rank files are in place but {META} is not: do not use it."
            )
    comm.raise_together(error, _elsewhere())  # also a barrier: no rank returns before meta.json exists


# -- reading -------------------------------------------------------------------------------------------------
def read_meta(path) -> dict:
    """meta.json of checkpoint directory `path`, with an error that says what is wrong if there is none."""
    path = Path(path)
    if not path.is_dir():
        why = "it is not a directory" if path.exists() else "no such directory"
        raise CheckpointError(f"no checkpoint at {path}: {why}; pass the directory save_checkpoint wrote")
    meta_file = path / META
    if not meta_file.is_file():
        if any(_RANK_FILE.fullmatch(p.name) for p in path.iterdir()):
            raise CheckpointError(
                f"{path} has rank files but no {META}: the save did not finish on every rank (rank 0 writes "
                f"{META} last); use an earlier checkpoint"
            )
        raise CheckpointError(
            f"{path} is not a checkpoint: it has no {META} and no rank files; write one with "
            "engine.save_checkpoint(path)"
        )
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {meta_file}: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_file} is not a {FORMAT} checkpoint summary")
    for key, least, most in (("world_size", 1, None), ("global_steps", 0, None), ("stage", 0, 3)):
        value = meta.get(key)
        if not _whole(value, least) or (most is not None and value > most):
            found = "missing" if key not in meta else f"{value!r}"
            bound = f"from {least} to {most}" if most is not None else f"of at least {least}"
            raise CheckpointError(
                f"{meta_file}: field {key} is {found}, expected a whole number {bound}; {_EDITED}"
            )
    return meta


_EDITED = "the file is damaged or was edited; resume from an earlier checkpoint"


def _whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _check_layout(file: Path, saved: dict) -> None:
    """The fields that putting pieces together relies on, checked so that a damaged or edited rank file
    gives an error that names the field instead of an IndexError deep inside the loading."""

    def bad(field: str, value, expected: str):
        raise CheckpointError(f"{file}: field {field} is {value!r}, expected {expected}; {_EDITED}")

    try:
        for name, shape in saved["params"].items():
            if not isinstance(shape, list) or not all(_whole(n, 0) for n in shape):
                bad(f"params[{name!r}]", shape, "a list of sizes")
        for name, pieces in saved["pieces"].items():
            for i, piece in enumerate(pieces):
                field = f"pieces[{name!r}][{i}]"
                if not _whole(piece["start"], 0):
                    bad(f"{field}.start", piece["start"], "a whole number of at least 0")
                for key in STATES:
                    tensor = piece[key]
                    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
                        bad(f"{field}.{key}", tensor, "a one-dimensional tensor")
                    if tensor.numel() != piece["master"].numel():
                        bad(f"{field}.{key}", tensor, f"{piece['master'].numel()} elements, as master has")
        if not all(isinstance(t, torch.Tensor) for t in saved["extras"].values()):
            bad("extras", saved["extras"], "a tensor per buffer")
        if not isinstance(saved["rng"], dict):
            bad("rng", saved["rng"], "a dictionary of random states")
    except (KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(
            f"{file}: its contents are not laid out as a rank file ({type(err).__name__}: {err}); {_EDITED}"
        ) from err


def _check_sums(file: Path, saved: dict, expected: bool) -> bool:
    """Compare every tensor with the checksum saved beside it; False for a file saved without them."""
    sums = saved.get(CHECKSUMS)
    if sums is None and not expected:
        return False
    tensors = _tensors(saved)
    if not isinstance(sums, dict) or sums.keys() != tensors.keys():
        raise CheckpointError(
            f"{file}: field {CHECKSUMS} does not list one checksum per tensor of the file; the file is "
            "damaged; resume from an earlier checkpoint"
        )
    for label, tensor in tensors.items():
        if _crc32(tensor) != sums[label]:
            raise CheckpointError(
                f"{file}: the tensor {label} does not match its checksum ({CHECKSUMS}): the file is damaged; "
                "resume from an earlier checkpoint"
            )
    return True


def _load_file(file: Path) -> dict:
    if not zipfile.is_zipfile(
        file
    ):  # torch.save writes a zip; anything else is never handed to the unpickler
        raise CheckpointError(
            f"cannot read {file}: it is not a file torch.save wrote; it is damaged or foreign"
        )
    try:
        # mmap: a rank reads only the pages it needs of the other ranks' files.
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"WeightsUnpickler error: ([^\n]*?)(?:\. |\n|$)", str(err))
        what = found.group(1) if found else "content the safe loader does not allow"
        raise CheckpointError(
            f"refusing to load {file}: it holds objects other than tensors and plain Python values ({what}), "
            "and unpickling them could run code. zero_offload checkpoints never contain such objects: do not "
            "use this file unless you know who made it and why"
        ) from None
    except (OSError, RuntimeError, ValueError, EOFError) as err:
        raise CheckpointError(f"cannot read {file}: {err}; the file is damaged or not a checkpoint") from err


def _read(path) -> list[dict]:
    """Every rank file of checkpoint `path`, checked to belong to one and the same save."""
    path = Path(path)
    meta = read_meta(path)
    world = int(meta["world_size"])
    names = [rank_file(r, world) for r in range(world)]
    missing = [name for name in names if not (path / name).is_file()]
    if missing:
        raise CheckpointError(
            f"{path} was saved by {world} ranks but {len(missing)} rank file(s) are missing: "
            f"{', '.join(missing)}; copy the whole directory"
        )
    files = [_load_file(path / name) for name in names]
    unchecked = []
    for rank, (name, saved) in enumerate(zip(names, files, strict=True)):
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise CheckpointError(f"{path / name} is not a {FORMAT} rank file")
        _check_layout(path / name, saved)
        if not _check_sums(path / name, saved, expected=meta.get("checksums") == CHECKSUMS):
            unchecked.append(name)
        found = (saved["rank"], saved["world_size"], saved["global_steps"])
        if found != (rank, world, meta["global_steps"]):
            raise CheckpointError(
                f"{path / name} holds rank {found[0]} of {found[1]} at step {found[2]}, but {META} describes "
                f"rank {rank} of {world} at step {meta['global_steps']}: the directory mixes two saves"
            )
        if saved["params"] != files[0]["params"]:
            raise CheckpointError(
                f"{path / name} and {path / names[0]} list different parameters: the directory mixes two saves"
            )
    if unchecked:
        # Loaded, not refused: they predate checksums, which guard against damage, not against a forger (who
        # could recompute them); refusing would strand every run saved before. weights_only still applies.
        warnings.warn(
            f"{path} was saved without checksums (by an earlier version), so damage to its tensors cannot be "
            "detected; save it again to add them",
            stacklevel=3,
        )
    return files


def _assemble(path, files: list[dict], keys: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """Whole flattened fp32 tensors per parameter name, put together from every rank's pieces."""
    shapes = files[0]["params"]
    full = {name: {k: torch.zeros(math.prod(shape)) for k in keys} for name, shape in shapes.items()}
    spans: dict[str, list[tuple[int, int, int]]] = {name: [] for name in shapes}
    for saved in files:
        for name, pieces in saved["pieces"].items():
            for piece in pieces:
                start, numel = piece["start"], piece["master"].numel()
                if name not in full or start + numel > full[name][keys[0]].numel():
                    raise CheckpointError(
                        f"{path}: rank {saved['rank']} holds a piece of {name} that does not fit; {_EDITED}"
                    )
                for key in keys:
                    full[name][key][start : start + numel] = piece[key]
                spans[name].append((start, start + numel, saved["rank"]))
    for name, shape in shapes.items():
        _check_coverage(path, name, math.prod(shape), spans[name])
    return full


def _check_coverage(path, name: str, numel: int, spans: list[tuple[int, int, int]]) -> None:
    """The pieces of parameter `name` must cover it once: no element missing, none in two pieces."""
    end, owner = 0, None
    for start, stop, rank in [*sorted(s for s in spans if s[1] > s[0]), (numel, numel, None)]:
        if start < end:
            raise CheckpointError(
                f"{path}: elements {start}-{min(stop, end) - 1} of {name} are in two pieces (ranks {owner} and "
                f"{rank}): the rank files mix two saves or were edited; resume from an earlier checkpoint"
            )
        if start > end:
            raise CheckpointError(
                f"{path}: elements {end}-{start - 1} of {name} are in no rank file's pieces: the checkpoint is "
                "damaged; resume from an earlier checkpoint"
            )
        end, owner = max(end, stop), rank


def _shapes(entries: dict) -> dict[str, list[int]]:
    return {key: list(value.shape) for key, value in entries.items()}


def _check_fits(path, saved: dict, model: torch.nn.Module) -> None:
    """Name each parameter or buffer that the checkpoint and the model do not both have, in the same shape."""
    entries = _model_entries(model)
    ours = {name: list(p.shape) for name, p in model.named_parameters() if p.requires_grad}
    ours_extras = _shapes({k: t for k, t in entries.items() if not isinstance(t, str)})
    problems = []
    for what, theirs, mine in (
        ("parameter", saved["params"], ours),
        ("buffer", _shapes(saved["extras"]), ours_extras),
    ):
        for name in sorted(theirs.keys() - mine.keys()):
            problems.append(f"{what} {name} {theirs[name]} is in the checkpoint but not in the model")
        for name in sorted(mine.keys() - theirs.keys()):
            problems.append(f"{what} {name} {mine[name]} is in the model but not in the checkpoint")
        for name in sorted(theirs.keys() & mine.keys()):
            if theirs[name] != mine[name]:
                problems.append(
                    f"{what} {name} has shape {theirs[name]} in the checkpoint, {mine[name]} in the model"
                )
    if problems:
        shown = "\n  ".join(problems[:20]) + (
            f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        )
        raise CheckpointError(
            f"the checkpoint {path} does not fit this model:\n  {shown}\n"
            "load it into the model it was saved from (the same preset and settings)"
        )


# -- loading -------------------------------------------------------------------------------------------------
def load_checkpoint(engine, path) -> None:
    """Resume `engine` from checkpoint `path`, saved at any world size and stage: its pieces are re-cut here.

    Every rank reads every rank file and rebuilds whole fp32 parameters (and m, v) before taking its own
    shard: host memory for three fp32 copies of the model, but the resharding stays obvious.
    """
    files = _read(path)
    saved = files[0]
    _check_fits(path, saved, engine.model)
    full = _assemble(path, files, STATES)
    states, optimizer, rank = engine.states, engine.optimizer, engine.comm.rank
    with torch.no_grad():
        for index, tensors, unit_pieces in _units(engine, write=True):
            for tensor in tensors.values():
                tensor.zero_()  # the padding of a shard is zero, as a fresh engine has it
            optimizer.state[states.master_params[index]]["step"].fill_(saved["optimizer_step"])
            for name, start, numel, offset in unit_pieces:
                for key, tensor in tensors.items():
                    tensor[offset : offset + numel].copy_(full[name][key][start : start + numel])
        for key, tensor in _model_entries(engine.model).items():
            if not isinstance(tensor, str):
                tensor.copy_(saved["extras"][key])
    engine.zero_grad()  # gradients of an unfinished accumulation belong to the run we leave
    _load_scaler(engine, saved)
    _load_scheduler(engine, saved)
    engine.global_steps = saved["global_steps"]
    engine.micro_steps = saved["micro_steps"]
    engine.skipped_steps = saved["skipped_steps"]
    # Same world size: each rank continues its own random stream. Otherwise ranks beyond the old ones take
    # rank 0's; the streams then differ from the old run's anyway.
    rng = files[rank if rank < len(files) else 0]["rng"]
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    states.publish()  # the weights forward reads, rounded from the loaded masters (stages 1/2: all-gathered)
    engine.accelerator.fence_copies()  # and landed before the caller can write a parameter itself


def _load_scaler(engine, saved: dict) -> None:
    kind = type(engine.scaler).__name__
    if saved["scaler"]["kind"] == kind:
        engine.scaler.load_state_dict(saved["scaler"]["state"])
    else:
        warnings.warn(
            f"the checkpoint's loss scaler is a {saved['scaler']['kind']} ({saved['precision']}), this "
            f"engine's a {kind} ({engine.config.precision}): the loss scale starts afresh",
            stacklevel=4,
        )


def _load_scheduler(engine, saved: dict) -> None:
    ours, theirs = engine.lr_scheduler, saved["lr_scheduler"]
    if ours is not None and theirs is not None:
        ours.load_state_dict(theirs)
    elif ours is not None or theirs is not None:
        if ours is not None:
            which = "the config has a scheduler, the checkpoint none"
        else:
            which = "the checkpoint has one, the config not"
        warnings.warn(f"lr scheduler: {which}; the learning rate follows the config from here", stacklevel=4)


# -- one plain state_dict ------------------------------------------------------------------------------------
def consolidate(path) -> dict[str, torch.Tensor]:
    """The fp32 weights of checkpoint `path` as one plain PyTorch state_dict of the unwrapped model.

    A tied weight appears under every key the model's state_dict has for it, as one tensor; buffers and frozen
    parameters are included as they were saved.
    """
    files = _read(path)
    saved = files[0]
    full = _assemble(path, files, ("master",))
    weights = {name: full[name]["master"].view(shape) for name, shape in saved["params"].items()}
    return {
        key: weights[saved["aliases"][key]] if key in saved["aliases"] else saved["extras"][key].clone()
        for key in saved["state_dict_keys"]
    }


def to_fp32(path, out) -> dict[str, torch.Tensor]:
    """Write consolidate(path) to file `out`, atomically: `model.load_state_dict(torch.load(out, ...))`."""
    state, out = consolidate(path), Path(out)
    try:
        os.replace(write_temp(out, lambda file: torch.save(state, file)), out)
    except OSError as err:
        raise CheckpointError(f"could not write {out}: {err.strerror or err}") from err
    return state
