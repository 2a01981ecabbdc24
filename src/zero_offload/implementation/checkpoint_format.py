"""What goes into a checkpoint's files (checkpoint.py describes the directory as a whole).

A rank's file holds its pieces of the fp32 master weights and of Adam's m and v (in the precision the host's
Adam keeps them: module 4's `cpu_adam.states`), each labelled with the parameter's name and where it starts in
the flattened parameter, so that any world size or stage can put them back together; then what it takes to resume, and a CRC-32 per tensor. Only tensors and plain Python values go
in, so that `torch.load(weights_only=True)` can read it. meta.json repeats the summary in readable form.

Under the delayed update (practice/dpu.py) a save can fall between an Adam that has run and its publish, which
the next step does: forward still reads the weights from before that update. Then `publish_pending` is true
and each piece also holds those weights, as fp32 (`published`: exact, since they are fp32's or fp32 rounded
to fp16/bf16), so that loading can put them where forward reads them and leave the landed update to the next
step, as the run that saved does.
"""

from __future__ import annotations

import datetime
import io
import math
import re
import zlib

import torch

from .durable import host_bytes

FORMAT = "zero_offload.checkpoint/1"
META = "meta.json"
STATES = ("master", "exp_avg", "exp_avg_sq")
# Module 4's 8-bit moments: each piece also holds the fp32 scales of the blocks it touches, and where in the
# first of them it starts (tuning/moment_codec.py cuts and decodes them; m and v keep their stored dtype).
SCALES = ("exp_avg_scale", "exp_avg_sq_scale")
BLOCK_OFFSET = "block_offset"
CLIENT_STATE = "client_state"  # the script's own values (engine.save_checkpoint(client_state=...))
PUBLISHED = "published"  # the weights forward reads, in pieces of a checkpoint with a publish pending
CHECKSUMS = "crc32"
RANK_FILE_NAME = re.compile(r"rank(\d{5})-of-(\d{5})\.pt")


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
    if engine.config.zero_optimization.stage == 0:  # one flat buffer, cut into a master piece per group run
        found, index, offset = [], 0, 0
        for param in states.params:
            if offset == states.master_lengths[index]:
                index, offset = index + 1, 0
            found.append((names[id(param)], 0, param.numel(), index, offset))
            offset += param.numel()
        return found
    return [
        (names[id(unit.params[s.param])], s.param_start, s.numel, index, s.shard_start)
        for index, unit in enumerate(states.units)
        for s in unit.layout.slices
    ]


def param_group_records(engine) -> list[dict]:
    """Each parameter group as plain values: its parameters' names and its lr, betas, eps and weight_decay."""
    groups = engine.groups
    return [
        {**settings, "betas": list(settings["betas"]), "params": names}
        for settings, names in zip(groups.settings, groups.names(engine.model), strict=True)
    ]


def saved_param_groups(saved: dict) -> list[dict]:
    """The groups rank file `saved` records; a checkpoint of an earlier version had one, of every parameter."""
    return saved.get("param_groups") or [{"params": sorted(saved["params"])}]


def piece_keys(saved: dict, piece: dict | None = None) -> tuple[str, ...]:
    """The tensors that each piece of rank file `saved` holds with as many elements as its master; with
    `piece`, also the block scales it holds (8-bit moments)."""
    keys = (*STATES, PUBLISHED) if saved.get("publish_pending") else STATES
    return keys if piece is None else (*keys, *(key for key in SCALES if key in piece))


def _optimizer_tensors(engine, index: int) -> dict[str, torch.Tensor]:
    """master_params[index] and its moments, as the optimizer holds them (its own buffers, not copies), and
    the 8-bit moments' block scales."""
    master = engine.states.master_params[index]
    state = engine.optimizer.state[master]
    tensors = {"master": master, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
    tensors.update({key: state[key] for key in SCALES if key in state})
    return tensors


def units_of(engine, *, write: bool = False):
    """(index, tensors, pieces) for every master partition, in order: its _optimizer_tensors and its pieces
    (name, start, numel, offset). On the NVMe tier (practice/nvme.py) the tensors are valid only until
    the next index: they pass through host memory a sub-group at a time, read from the files, or with `write`
    written back to them after the caller has filled them."""
    pieces: dict[int, list] = {}
    for name, start, numel, index, offset in _pieces(engine):
        pieces.setdefault(index, []).append((name, start, numel, offset))
    for index in engine.states.each_unit(write=write):
        yield index, _optimizer_tensors(engine, index), pieces.get(index, [])


def model_entries(model: torch.nn.Module) -> dict[str, str | torch.Tensor]:
    """The model's state_dict, in its order: for a trainable parameter, the name it is saved under (a tied
    weight has an entry per key); for anything else (buffers, frozen parameters), the tensor itself."""
    names = _param_names(model)
    return {key: names.get(id(tensor), tensor) for key, tensor in model.state_dict(keep_vars=True).items()}


def rank_state(engine, client_state=None) -> dict:
    """Everything this rank writes: plain Python values and CPU tensors only, and the script's `client_state`."""
    comm, model, stage = engine.comm, engine.model, engine.config.zero_optimization.stage
    # A delayed update in flight writes the masters and moments: wait for it, but leave its publish to the run.
    pending = engine.optimizer_step.land()
    pieces: dict[str, list[dict]] = {}
    # Stage 0 ranks hold identical replicas: rank 0's copy is enough.
    if stage > 0 or comm.rank == 0:
        for index, tensors, unit_pieces in units_of(engine):
            if pending:  # the delayed update runs only on offloaded shards: forward reads their device copy
                tensors = {**tensors, PUBLISHED: engine.states.param_shards[index].float()}
            for name, start, numel, offset in unit_pieces:
                piece = {"start": start}
                for key, value in engine.moment_codec.cut_piece(tensors, offset, numel).items():
                    # A copy of just the piece: saving a view would write its whole storage (the flat buffer).
                    is_tensor = isinstance(value, torch.Tensor)
                    piece[key] = value.detach().to("cpu", copy=True) if is_tensor else value
                pieces.setdefault(name, []).append(piece)
    entries = model_entries(model)
    # Buffers and frozen weights are the same on every rank (data parallelism): rank 0 saves them.
    others = {k: t for k, t in entries.items() if not isinstance(t, str)} if comm.rank == 0 else {}
    scheduler = engine.lr_scheduler
    state = {
        "format": FORMAT,
        "rank": comm.rank,
        "world_size": comm.world_size,
        "stage": stage,
        "precision": engine.config.precision,
        # How the host's Adam stored m and v (module 4): a run with other moments converts them on load.
        "moments": engine.config.zero_offload.cpu_adam.states,
        "fingerprint": engine.config.fingerprint(),
        "config": engine.config.to_dict(),
        "params": {name: list(p.shape) for name, p in model.named_parameters() if p.requires_grad},
        # The parameter groups (engine/param_groups.py): each one's members by name and its settings.
        "param_groups": param_group_records(engine),
        "state_dict_keys": list(entries),
        "aliases": {key: name for key, name in entries.items() if isinstance(name, str)},
        "extras": {key: tensor.detach().to("cpu", copy=True) for key, tensor in others.items()},
        "pieces": pieces,
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "skipped_in_a_row": engine.skip_guard.in_a_row,  # engine/divergence.py stops a run at too many
        "history": list(engine.history),
        "publish_pending": pending,
        # Every step updates every master tensor, so they all share one count.
        "optimizer_step": float(engine.optimizer.state[engine.states.master_params[0]]["step"]),
        "scaler": {"kind": type(engine.scaler).__name__, "state": engine.scaler.state_dict()},
        "lr_scheduler": None if scheduler is None else scheduler.state_dict(),
        "rng": {
            "cpu": torch.get_rng_state(),
            # Only if CUDA was used: asking an unused CUDA for its state would create a context for nothing.
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
        },
        CLIENT_STATE: _to_cpu({} if client_state is None else client_state),
    }
    state[CHECKSUMS] = {label: crc32(tensor) for label, tensor in saved_tensors(state).items()}
    return state


def saved_tensors(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a rank file, by the label its checksum is stored under and an error names it by."""
    found = {
        f"{name} piece {i} {key}": piece[key]
        for name, pieces in state["pieces"].items()
        for i, piece in enumerate(pieces)
        for key in piece_keys(state, piece)
    }
    found.update({f"buffer {key}": tensor for key, tensor in state["extras"].items()})
    found.update({f"rng {key}": t for key, t in state["rng"].items() if isinstance(t, torch.Tensor)})
    found.update(_tensors_in(state.get(CLIENT_STATE, {}), CLIENT_STATE))  # older checkpoints have none
    return found


def _to_cpu(value):
    """`value` with every tensor in it copied to the host: a rank file is loaded on machines without the device."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(item) for item in value)
    return value


def _tensors_in(value, label: str) -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {label: value}
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, (list, tuple))
        else ()
    )
    found = {}
    for key, item in items:
        found.update(_tensors_in(item, f"{label} {key}"))
    return found


def client_state_problem(client_state) -> Exception | None:
    """Why `client_state` cannot go into a checkpoint, or None. A rank file must load with
    torch.load(weights_only=True), which refuses objects of arbitrary classes: find that out before saving."""
    if client_state is None:
        return None
    if not isinstance(client_state, dict):
        return TypeError(f"client_state must be a dict of plain values, got {type(client_state).__name__}")
    buffer = io.BytesIO()
    try:
        torch.save(_to_cpu(client_state), buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as err:
        return TypeError(
            f"client_state cannot be saved so that it loads safely (torch.load(weights_only=True)): {err}. "
            "Keep it to dicts, lists, tuples, strings, numbers, booleans, None and tensors; turn other "
            "objects into those (e.g. a sampler's state_dict()) before saving"
        )
    return None


def crc32(tensor: torch.Tensor) -> int:
    # CRC-32: 2.8 GB/s on one core here (blake2b 0.5, adler32 1.7), so the 200 MB of a 16.7M-parameter
    # model's states cost ~70 ms; it finds damage, not a forger, who could recompute it.
    return zlib.crc32(host_bytes(tensor.detach().contiguous()))


def meta_summary(engine, state: dict) -> dict:
    return {
        "format": FORMAT,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "world_size": state["world_size"],
        "stage": state["stage"],
        "precision": state["precision"],
        "moments": state["moments"],
        "fingerprint": state["fingerprint"],
        "num_parameters": sum(math.prod(shape) for shape in state["params"].values()),
        "global_steps": state["global_steps"],
        "micro_steps": state["micro_steps"],
        "skipped_steps": state["skipped_steps"],
        "publish_pending": state["publish_pending"],
        "optimizer_step": state["optimizer_step"],
        "loss_scale": engine.scaler.scale,
        "lr": [group["lr"] for group in engine.optimizer.param_groups],
        "files": [rank_file(r, state["world_size"]) for r in range(state["world_size"])],
        "checksums": CHECKSUMS,  # every rank file has one per tensor; older checkpoints have none
        "config": state["config"],
    }
