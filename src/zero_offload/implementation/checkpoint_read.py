"""Reading a checkpoint back, and refusing one that is damaged, incomplete or foreign.

Every tensor was saved with its CRC-32 and is checked here, as are the fields that putting the pieces back
together relies on, and the pieces themselves (each element of each parameter in exactly one): a damaged or
hand-edited checkpoint is refused, naming the file and the tensor or field, instead of loading wrong weights.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import warnings
import zipfile
from pathlib import Path

import torch

from .checkpoint_format import (
    CHECKSUMS,
    FORMAT,
    META,
    RANK_FILE_NAME,
    crc32,
    model_entries,
    param_group_records,
    piece_keys,
    rank_file,
    saved_param_groups,
    saved_tensors,
)
from .checkpoint_tags import checkpoint_folder
from .durable import CheckpointError


def read_meta(path) -> dict:
    """meta.json of checkpoint directory `path` (of the save its `latest` names), with an error that says what
    is wrong if there is none."""
    path = checkpoint_folder(path)
    if not path.is_dir():
        why = "it is not a directory" if path.exists() else "no such directory"
        raise CheckpointError(f"no checkpoint at {path}: {why}; pass the directory save_checkpoint wrote")
    meta_file = path / META
    if not meta_file.is_file():
        if any(RANK_FILE_NAME.fullmatch(p.name) for p in path.iterdir()):
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
                for key in piece_keys(saved):
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
    tensors = saved_tensors(saved)
    if not isinstance(sums, dict) or sums.keys() != tensors.keys():
        raise CheckpointError(
            f"{file}: field {CHECKSUMS} does not list one checksum per tensor of the file; the file is "
            "damaged; resume from an earlier checkpoint"
        )
    for label, tensor in tensors.items():
        if crc32(tensor) != sums[label]:
            raise CheckpointError(
                f"{file}: the tensor {label} does not match its checksum ({CHECKSUMS}): the file is damaged; "
                "resume from an earlier checkpoint"
            )
    return True


def _load_file(file: Path) -> dict:
    # torch.save writes a zip; anything else is never handed to the unpickler.
    if not zipfile.is_zipfile(file):
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


def read_rank_files(path) -> list[dict]:
    """Every rank file of checkpoint `path`, checked to belong to one and the same save."""
    path = checkpoint_folder(path)
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


def assemble(
    path, files: list[dict], keys: tuple[str, ...], decode=None
) -> dict[str, dict[str, torch.Tensor]]:
    """Whole flattened fp32 tensors per parameter name, put together from every rank's pieces.

    `decode(piece)`: the fp32 m and v of a piece whose moments are stored below fp32 (module 4's
    tuning/moment_codec.py: 8-bit codes need their block scales); None reads only what is fp32 or bf16."""
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
                values = _decoded(path, saved, name, piece, keys, decode)
                for key in keys:
                    full[name][key][start : start + numel] = values[key]
                spans[name].append((start, start + numel, saved["rank"]))
    for name, shape in shapes.items():
        _check_coverage(path, name, math.prod(shape), spans[name])
    return full


def _decoded(path, saved: dict, name: str, piece: dict, keys: tuple[str, ...], decode) -> dict:
    moments = [key for key in ("exp_avg", "exp_avg_sq") if key in keys]
    if not moments or piece[moments[0]].dtype in (torch.float32, torch.bfloat16):
        return piece  # fp32, or bf16 (which fp32 holds exactly)
    if decode is None:
        raise CheckpointError(
            f"{path}: the 8-bit moments of {name} need their decoder (tuning/moment_codec.py)"
        )
    try:
        return {**piece, **decode(piece)}
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{path}: rank {saved['rank']}'s piece of {name} does not hold readable 8-bit moments ({err}); "
            f"{_EDITED}"
        ) from None


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


def check_fits(path, saved: dict, model: torch.nn.Module) -> None:
    """Name each parameter or buffer that the checkpoint and the model do not both have, in the same shape."""
    entries = model_entries(model)
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


def check_same_groups(path, saved: dict, engine) -> None:
    """The checkpoint's parameter groups hold the parameters this engine's do, group by group: Adam's moments
    were made under those settings. Settings that changed (a new lr, say) are the script's to change: a warning
    says which."""
    theirs = saved_param_groups(saved)
    ours = param_group_records(engine)
    group_there = {name: i for i, group in enumerate(theirs) for name in group["params"]}
    group_here = {name: i for i, group in enumerate(ours) for name in group["params"]}
    moved = [(name, group_there.get(name), i) for name, i in group_here.items() if group_there.get(name) != i]
    if len(theirs) != len(ours) or moved:
        shown = "; ".join(f"{name} is in group {there} there, {here} here" for name, there, here in moved[:3])
        raise CheckpointError(
            f"the checkpoint {path} was saved with {len(theirs)} parameter group(s) and this engine has "
            f"{len(ours)}{': ' + shown if shown else ''}. Build the same groups as the run that saved, or load "
            "with load_optimizer_states=False (the weights only; Adam starts afresh under the new groups)"
        )
    changed = [
        f"group {i} {key} {there[key]} -> {here[key]}"
        for i, (there, here) in enumerate(zip(theirs, ours, strict=True))
        for key in ("lr", "betas", "eps", "weight_decay")
        if key in there and there[key] != here[key]
    ]
    if changed:
        warnings.warn(
            f"the parameter groups' settings differ from the checkpoint's ({', '.join(changed)}); "
            "this run's settings are used from here",
            stacklevel=4,
        )
