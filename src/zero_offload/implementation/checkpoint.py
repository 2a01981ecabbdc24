"""Checkpoints that outlive the run that wrote them: any world size or ZeRO stage can load them.

`save_checkpoint(engine, dir, tag=None)` writes one save into its own folder and then points `latest` at it:

  dir/step00000016/         one save (its tag defaults to the step; pass tag= to choose one)
    rank00000-of-00002.pt   one file per rank: its pieces of the fp32 master weights and of Adam's m and v,
    rank00001-of-00002.pt   each labelled with the parameter's name and where it starts in the flattened
                            parameter; and what it takes to resume: steps, Adam's step count, loss scale,
                            lr schedule, RNG states
    meta.json               a readable summary, written by rank 0 once every rank's file is in place
  dir/latest                the tag of the newest complete save, replaced by rank 0 last of all

A save killed at any moment leaves `latest` naming the previous save, whole; checkpoint_tags.py says how
loading follows `latest` and which older saves are kept. `load_checkpoint(engine, dir)` also loads a folder
that holds rank files and meta.json itself: one save's folder, or a checkpoint written before tags.

Pieces are stored by parameter name, not by shard, because a shard is an accident of the run: stage 0 keeps
one flat buffer, stages 1-3 cut each module's buffer into world-size shards with padding. Loading puts the
pieces back together into whole parameters and cuts them again for the engine that loads. The files hold only
tensors and plain Python values, so they load with `torch.load(weights_only=True)`: a checkpoint from someone
else cannot run code.

Every tensor is saved with its CRC-32 and checked on loading, as are the pieces (each element of each parameter
in exactly one): a damaged or hand-edited checkpoint is refused, naming the file and the tensor or field,
instead of loading wrong weights.

A resumed run is the run that was never interrupted, bit for bit, and saving does not change the run that
saves. Besides the states, a rank file holds the step history and the count of skipped steps in a row
(engine/divergence.py). Under the delayed update (practice/dpu.py) a save falls between an Adam that has run and
its publish: the rank file holds the landed masters and moments, the weights forward reads (one update old)
and a flag that the publish is pending. Loading publishes those weights, puts the landed masters back and
leaves their publish to the next step, as in the run that saved; an engine that does not delay that step
(another config) publishes the landed update at load, with a warning.

This file saves and loads; checkpoint_format.py says what goes into each file, checkpoint_read.py reads the
files back and verifies them, checkpoint_tags.py finds the save to load, durable.py writes files safely.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from . import checkpoint_tags as tags
from .checkpoint_format import (
    CHECKSUMS,
    CLIENT_STATE,
    FORMAT,
    META,
    PUBLISHED,
    STATES,
    client_state_problem,
    meta_summary,
    model_entries,
    piece_keys,
    rank_file,
    rank_state,
    saved_tensors,
    units_of,
)
from .checkpoint_read import assemble, check_fits, check_same_groups, read_meta, read_rank_files
from .checkpoint_tags import checkpoint_folder, complete
from .durable import CheckpointError, fsync_dir, mount_point, os_error_behind, write_error, write_temp

# Importers (the engine, the trainer, the `zo` command, tests) take these from here.
__all__ = [
    "CHECKSUMS",
    "FORMAT",
    "META",
    "STATES",
    "CheckpointError",
    "LoadOptions",
    "checkpoint_folder",
    "complete",
    "consolidate",
    "load_checkpoint",
    "rank_file",
    "read_meta",
    "save_checkpoint",
    "to_fp32",
]


# -- writing -------------------------------------------------------------------------------------------------
def _megabytes(nbytes: int) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


def _last_good(engine, path: Path) -> str:
    """Where the run can go back to: the engine's last checkpoint, or one already in `path`, if complete."""
    last = engine.skip_guard.last_checkpoint
    if last is not None and tags.complete(last[0]):
        return f"The last good checkpoint is {last[0]} (step {last[1]})."
    if tags.complete(path):
        return f"The last good checkpoint is the one already in {path}."
    return "No earlier checkpoint is known to this run."


def _save_error(engine, path: Path, final: Path, state: dict, err: Exception, outcome: str) -> Exception:
    """The CheckpointError for a rank file that could not be written: a full disk names the disk, the bytes
    the checkpoint needs and the last good checkpoint. Anything that is no write failure passes unchanged."""
    found = os_error_behind(err)
    directory = next((d for d in (final.parent, *final.parents) if d.is_dir()), final.parent)
    free = shutil.disk_usage(directory).free  # after the temporary file is gone: what the save had to use
    mine = sum(t.numel() * t.element_size() for t in saved_tensors(state).values())
    extras = sum(t.numel() * t.element_size() for t in state["extras"].values())
    needed = len(STATES) * 4 * sum(math.prod(shape) for shape in state["params"].values()) + extras
    full = found is not None and found.errno in (errno.ENOSPC, errno.EDQUOT)
    if full or (found is None and free < mine):
        return CheckpointError(
            f"could not write {final}: {os.strerror(errno.ENOSPC)}: the disk at {mount_point(directory)} has "
            f"{_megabytes(free)} free, and the checkpoint needs about {_megabytes(needed)} in all "
            f"({_megabytes(mine)} for this rank's file); free some space on that disk or save to another "
            f"directory. {outcome} {_last_good(engine, path)}"
        )
    return err if found is None else write_error(final, found, outcome)


def _elsewhere(outcome: str = "") -> CheckpointError:
    return CheckpointError(
        f"another rank could not write its part of the checkpoint; see that rank's error. {outcome}".strip()
    )


def _raise_together(comm, error, elsewhere, folder: Path) -> None:
    """comm.raise_together; when it raises, every rank is done with `folder`, and rank 0 removes the save."""
    try:
        comm.raise_together(error, elsewhere)
    except CheckpointError:  # not a lost rank (that raises something else): nobody writes there any more
        if comm.rank == 0:
            tags.discard(folder)
        raise


def save_checkpoint(
    engine, path, tag: str | None = None, *, client_state=None, save_latest: bool = True
) -> None:
    """Every rank writes its file into `path/tag`; rank 0 adds meta.json, then points `path/latest` at `tag`.

    Until `latest` moves, the previous checkpoint in `path` is the one that loads: a failure (a full disk) or a
    process killed anywhere in between leaves it whole. `tag` defaults to the step, e.g. step00000016.
    `client_state` (the script's own plain values: its step, its place in the data) is saved in this rank's
    file and given back by load_checkpoint. `save_latest=False` leaves `latest` where it was.
    """
    path, comm = Path(path), engine.comm
    # Every rank sees the same directory before rank 0 prepares it below: they pick the same default tag.
    tag = tags.check_tag(tags.default_tag(engine.global_steps, path) if tag is None else tag)
    folder = path / tag
    # Checked on every rank before anything is written: a value that torch.load(weights_only=True) refuses would
    # make the whole checkpoint unloadable.
    error, previous = client_state_problem(client_state), None
    state = rank_state(engine, client_state)
    kept = f"Any previous checkpoint in {path} is left as it was."
    if (
        comm.rank == 0 and error is None
    ):  # before any rank writes: the others must not find a folder that is about to go
        try:
            previous = tags.prepare(path, tag)
        except CheckpointError as err:
            error = err
        except OSError as err:
            error = write_error(folder, err, kept)
    comm.raise_together(error, _elsewhere(kept))
    final = folder / rank_file(comm.rank, comm.world_size)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.replace(write_temp(final, lambda file: torch.save(state, file)), final)
        fsync_dir(folder)
    except Exception as err:  # raised below on every rank, never here alone
        error = _save_error(engine, path, final, state, err, kept)
    _raise_together(comm, error, _elsewhere(f"{kept} {_last_good(engine, path)}"), folder)
    if comm.rank == 0:
        target = folder / META
        try:
            meta = json.dumps(meta_summary(engine, state), indent=2) + "\n"
            os.replace(write_temp(target, lambda file: file.write(meta.encode())), target)
            fsync_dir(folder)
            target = path / tags.LATEST
            if save_latest:
                tags.publish(path, tag)
        except OSError as err:
            error = write_error(target, err, kept)
    _raise_together(comm, error, _elsewhere(kept), folder)  # also a barrier: no rank returns before `latest`
    if comm.rank == 0:
        tags.prune(path, keep={tag, previous})


# -- loading -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadOptions:
    """What of a checkpoint to take (DeepSpeed's load_checkpoint flags): by default everything, to resume."""

    optimizer_states: bool = True  # Adam's m, v and step count; False: they start afresh from the weights
    lr_scheduler_states: bool = True  # False: the schedule follows the config from its start
    module_only: bool = False  # the weights alone: no optimizer, schedule, step counters, loss scale or RNG


@dataclass(frozen=True)
class TrainingState:
    """Where the training loop stood when the checkpoint was saved: load_checkpoint returns it, and the engine
    takes it up (its counters, its loss scaler, its skip guard), so that nothing here writes the engine's fields."""

    global_steps: int
    micro_steps: int
    skipped_steps: int
    skipped_in_a_row: int  # engine/divergence.py stops a run at too many
    history: list
    # None: the checkpoint's loss scaler is of another kind, the scale starts afresh
    scaler_state: dict | None


@dataclass(frozen=True)
class Loaded:
    """What load_checkpoint found: the save's folder, the script's client_state, and (unless only the weights
    were asked for) the training state to resume from."""

    folder: Path
    client_state: dict
    training: TrainingState | None


def load_checkpoint(engine, path, tag: str | None = None, options: LoadOptions = LoadOptions()) -> Loaded:
    """Load `engine`'s states from checkpoint `path` (its save `tag`, by default the one `latest` names), saved
    at any world size and stage: its pieces are re-cut here. Returns what the engine takes up.

    Every rank reads every rank file and rebuilds whole fp32 parameters (and m, v) before taking its own
    shard: host memory for three fp32 copies of the model, but the resharding stays obvious.
    """
    path = tags.checkpoint_folder(Path(path) / tags.check_tag(tag) if tag is not None else path)
    files = read_rank_files(path)
    saved = files[0]
    check_fits(path, saved, engine.model)
    if options.optimizer_states and not options.module_only:  # m and v are only valid under the same groups
        check_same_groups(path, saved, engine)
    full = assemble(path, files, piece_keys(saved), decode=engine.moment_codec.decode_piece)
    _warn_if_moments_convert(path, saved, engine)
    with torch.no_grad():
        for key, tensor in model_entries(engine.model).items():
            if not isinstance(tensor, str):
                tensor.copy_(saved["extras"][key])
    engine.zero_grad()  # gradients of an unfinished accumulation belong to the run we leave
    # Same world size: each rank gets back its own client_state and random stream. Otherwise ranks beyond the
    # old ones take rank 0's; the streams then differ from the old run's anyway.
    own = files[engine.comm.rank if engine.comm.rank < len(files) else 0]
    client_state = own.get(CLIENT_STATE, {})  # checkpoints of earlier versions have none
    state = None if options.module_only else _training_state(engine, saved, own["rng"], options)
    if options.optimizer_states and state is not None:
        _restore_weights(engine, full, saved, state.global_steps)
    else:
        _restore_weights_only(engine, full, saved)
    engine.accelerator.fence_copies()  # the weights landed before the caller can write a parameter itself
    return Loaded(path, client_state, state)


def _training_state(engine, saved: dict, rng: dict, options: LoadOptions) -> TrainingState:
    """The saved run's counters, loss scale and random streams (the schedule too, unless left out)."""
    if options.lr_scheduler_states:
        _load_scheduler(engine, saved)
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return TrainingState(
        global_steps=saved["global_steps"],
        micro_steps=saved["micro_steps"],
        skipped_steps=saved["skipped_steps"],
        # Checkpoints of earlier versions have neither: the count of skips in a row and the history start afresh.
        skipped_in_a_row=saved.get("skipped_in_a_row", 0),
        history=list(saved.get("history", [])),
        scaler_state=_scaler_state(engine, saved),
    )


def _write_states(
    engine, full: dict, optimizer_step: float, master: str = "master", *, moments: bool = True
) -> None:
    """This rank's shards of the masters and moments from the assembled `full`; the masters from `full`'s
    `master` tensors (the published weights, to publish those). `moments=False`: m and v start at zero, as in
    a fresh engine."""
    states, optimizer = engine.states, engine.optimizer
    with torch.no_grad():
        for index, tensors, unit_pieces in units_of(engine, write=True):
            weights = tensors["master"]
            weights.zero_()  # the padding of a shard is zero, as a fresh engine has it
            # m and v put together in fp32 first, then stored in this run's precision (module 4 may keep them in
            # bf16 or 8 bits, whose blocks span the whole unit).
            m, v = (torch.zeros(weights.numel()) for _ in range(2))
            optimizer.state[states.master_params[index]]["step"].fill_(optimizer_step)
            for name, start, numel, offset in unit_pieces:
                span = slice(start, start + numel)
                weights[offset : offset + numel].copy_(full[name][master][span])
                if moments:
                    m[offset : offset + numel] = full[name]["exp_avg"][span]
                    v[offset : offset + numel] = full[name]["exp_avg_sq"][span]
            engine.moment_codec.encode_into(m, v, tensors)


def _warn_if_moments_convert(path, saved: dict, engine) -> None:
    theirs, ours = saved.get("moments", "fp32"), engine.config.zero_offload.cpu_adam.states
    if theirs != ours and saved.get("pieces"):
        warnings.warn(
            f"the checkpoint {path} keeps Adam's m and v in {theirs} and this run in {ours}: they are converted "
            f"on load{', losing what ' + ours + ' cannot hold' if ours != 'fp32' else ''}",
            stacklevel=4,
        )


def _restore_weights_only(engine, full: dict, saved: dict) -> None:
    """The weights the saved model's forward read, as masters and published weights; Adam starts afresh (step
    count 0, m and v zero). Under a pending delayed update those are the published weights, not the landed
    masters: the module's weights are what was asked for."""
    weights = PUBLISHED if saved.get("publish_pending", False) else "master"
    _write_states(engine, full, 0.0, master=weights, moments=False)
    engine.states.publish()


def _restore_weights(engine, full: dict, saved: dict, global_steps: int) -> None:
    """The masters and moments, and the weights forward reads, as the run that saved had them.

    Most checkpoints hold weights that were published: forward reads them rounded from the masters (stages
    1/2: all-gathered). One saved under the delayed update between an Adam and its publish (practice/dpu.py)
    holds the weights forward read then as well: they are published first, then the landed masters go in,
    and the next step publishes them, as in the run that saved. If this engine runs no delayed update at
    that step (another config), the landed update is published here, with its lr-scheduler step."""
    pending = saved.get("publish_pending", False)
    held = pending and engine.optimizer_step.hold_landed(global_steps)
    if held:
        _write_states(engine, full, saved["optimizer_step"], master=PUBLISHED)
        engine.states.publish()
        engine.accelerator.record_event().wait()  # its uploads have read the masters before they change
    _write_states(engine, full, saved["optimizer_step"])
    if held:
        return
    engine.states.publish()
    if pending:
        if engine.lr_scheduler is not None:  # the publish moves the schedule on (DelayedUpdater.publish)
            engine.lr_scheduler.step()
        warnings.warn(
            f"the checkpoint was saved under the delayed update (delayed_param_update) with its last update "
            f"landed but not yet published; this engine does not delay step {global_steps}, so that "
            "update is published now: forward reads it one step earlier than the run that saved would have, "
            "and the two runs part from here",
            stacklevel=4,
        )


def _scaler_state(engine, saved: dict) -> dict | None:
    """The saved loss scaler's state, or None (with a warning) if it is not of the kind `engine` uses."""
    kind = type(engine.scaler).__name__
    if saved["scaler"]["kind"] == kind:
        return saved["scaler"]["state"]
    warnings.warn(
        f"the checkpoint's loss scaler is a {saved['scaler']['kind']} ({saved['precision']}), this "
        f"engine's a {kind} ({engine.config.precision}): the loss scale starts afresh",
        stacklevel=4,
    )
    return None


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
    path = tags.checkpoint_folder(path)
    files = read_rank_files(path)
    saved = files[0]
    full = assemble(path, files, ("master",))
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
