"""`deepspeed.initialize`, `add_config_arguments` and `init_distributed`, each over this engine's own pieces."""

from __future__ import annotations

import argparse
import atexit
import os

import torch

from ..engine.engine import Engine, close_open_engines
from ..engine.engine import initialize as zo_initialize
from ..engine.param_groups import group_tensors
from ..principles.process_group import free_port
from ..principles.process_group import init_distributed as join_group
from .client_optimizer import read_client_optimizer


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's two options, `--deepspeed` and `--deepspeed_config FILE`; returns the parser, as DeepSpeed's does."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="train with the engine")
    group.add_argument("--deepspeed_config", default=None, type=str, help="the DeepSpeed-style JSON config")
    return parser


_WITHOUT_EFFECT = {
    "auto_mpi_discovery",
    "distributed_port",
    "verbose",
    "init_method",
    "dist_init_required",
    "config",
    "rank",
    "world_size",
}


def init_distributed(dist_backend: str | None = None, timeout=None, **ignored) -> None:
    """Join the process group, the backend following the accelerator (gloo for the emulated device, NCCL for
    CUDA) unless `dist_backend` says otherwise. Under torchrun it joins the group torchrun describes; started
    without a launcher it makes a group of one, as DeepSpeed does. A group that exists already is kept."""
    # DeepSpeed's other arguments say how to find the ranks (MPI, a port, an init method); torchrun's
    # environment already says it.
    unknown = set(ignored) - _WITHOUT_EFFECT
    if unknown:
        raise TypeError(f"init_distributed() got unexpected arguments: {', '.join(sorted(unknown))}")
    if torch.distributed.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:  # no launcher: one process, meeting itself on loopback
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    seconds = timeout.total_seconds() if timeout is not None else None
    join_group(dist_backend, seconds)
    # The script made this group through us and, as DeepSpeed scripts do, may never destroy it: at exit it goes,
    # so that no gloo thread outlives the interpreter.
    atexit.register(_leave_group)


def _leave_group() -> None:
    close_open_engines()  # first: an engine closing may still wait on work of the group
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def initialize(
    args=None,
    model: torch.nn.Module | None = None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port=None,
    mpu=None,
    dist_init_required=None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
):
    """DeepSpeed's initialize: returns `(engine, engine.optimizer, training_dataloader, engine.lr_scheduler)`.

    The config comes from `config` (or its older name `config_params`): a dict or a JSON path; else from
    `args.deepspeed_config`. The optimizer and the schedule are the config's "optimizer" and "scheduler"
    sections; a torch.optim.Adam or AdamW given as `optimizer` stands for the first (client_optimizer.py).
    `model_parameters` may be the model's parameters or torch.optim-style groups of them, each with its own
    lr, betas, eps and weight_decay (engine/param_groups.py). `training_data` (a torch Dataset) becomes a
    DataLoader as DeepSpeed builds it: batches of train_micro_batch_size_per_gpu, a DistributedSampler over the
    ranks, drop_last from the config's "dataloader_drop_last"; None without it."""
    for name, value, why in (
        ("mpu", mpu, "model parallelism is not supported: the engine is data parallel, ZeRO stages 0-3"),
        ("mesh_param", mesh_param, "device meshes are not supported: the engine is data parallel"),
    ):
        if value is not None:
            raise NotImplementedError(f"initialize({name}=...): {why}; drop the argument")
    if model is None:
        raise ValueError("initialize() needs the model: initialize(model=net, ...)")
    _refuse_client_scheduler(lr_scheduler)
    source = _config_source(args, config, config_params)
    groups = None if model_parameters is None else list(model_parameters)
    if optimizer is not None:  # its settings become the config's optimizer section, its groups the groups
        source, client_groups = read_client_optimizer(optimizer, source)
        groups = _client_groups(client_groups, groups)
    engine = zo_initialize(model, source, param_groups=groups)
    loader = None if training_data is None else _loader(engine, training_data, collate_fn)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _config_source(args, config, config_params):
    if config is not None and config_params is not None:
        raise ValueError("initialize() got both config and config_params (its older name): pass one")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if config is not None and from_args is not None:
        raise ValueError(
            f"the config is given twice, as config= and as --deepspeed_config {from_args}: pass one of them"
        )
    config = config if config is not None else from_args
    if config is None:
        raise ValueError(
            "initialize() found no config: pass config= (a dict or a JSON path) or args with --deepspeed_config"
        )
    return config


def _refuse_client_scheduler(lr_scheduler) -> None:
    if lr_scheduler is not None:
        raise NotImplementedError(
            f"initialize(lr_scheduler=<{type(lr_scheduler).__name__}>): the engine steps its own schedule from "
            'the config: drop lr_scheduler= and write it as "scheduler": {"type": "WarmupLR", "params": {...}} '
            "(WarmupLR, WarmupDecayLR, WarmupCosineLR)"
        )


def _client_groups(client_groups: list[dict], model_parameters: list | None) -> list[dict]:
    """The client optimizer's groups; `model_parameters`, if given too, must name the same parameters."""
    if model_parameters is not None:
        given = {
            id(p)
            for item in model_parameters
            for p in (group_tensors(item) if isinstance(item, dict) else [item])
        }
        held = {id(p) for group in client_groups for p in group["params"]}
        if given != held:
            raise ValueError(
                "model_parameters and the optimizer's param groups hold different parameters; pass the same "
                "ones, or leave model_parameters out (the optimizer's groups are used)"
            )
    return client_groups


def _loader(engine: Engine, data, collate_fn) -> torch.utils.data.DataLoader:
    """DeepSpeed's training loader: each rank reads its share of `data` (a DistributedSampler, shuffled with
    seed 0 as torch's default), a micro-batch at a time."""
    sampler = torch.utils.data.DistributedSampler(
        data, num_replicas=engine.world_size, rank=engine.global_rank
    )
    return torch.utils.data.DataLoader(
        data,
        batch_size=engine.train_micro_batch_size_per_gpu(),
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=engine.config.dataloader_drop_last,
    )
