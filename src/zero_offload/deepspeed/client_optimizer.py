"""A script's own torch.optim.Adam or AdamW, read into the engine's terms: the config's optimizer section and the
parameter groups.

DeepSpeed runs a client optimizer as it is. The engine builds its own Adam instead, on the device or on the host
(module 3), in the fp32 masters' partitions; what it takes from the script's optimizer is what that optimizer
would have done: Adam or AdamW, its defaults, and each group's lr, betas, eps and weight_decay. An optimizer
that is not Adam, or asks for something the engine's Adam does not do, is refused by name.
"""

from __future__ import annotations

import os

import torch

from ..config import Config
from ..config.load import read_config_file
from ..engine.param_groups import INFORMATIONAL, SETTINGS

# torch's Adam/AdamW options the engine's Adam does not have, with the value that means "not used".
_UNSUPPORTED = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}


def read_client_optimizer(optimizer: torch.optim.Optimizer, config) -> tuple[dict, list[dict]]:
    """`config` (a dict, a JSON path or a Config) with an "optimizer" section for `optimizer`, and its groups."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise NotImplementedError(
            f"initialize(optimizer=<{type(optimizer).__name__}>): the engine runs Adam or AdamW only, its own, "
            "built from the config; pass a torch.optim.Adam or AdamW, or drop optimizer= and write "
            '"optimizer": {"type": "AdamW", "params": {...}} in the config'
        )
    data = _as_dict(config)
    if "optimizer" in data:
        raise ValueError(
            f'initialize() was given both optimizer=<{type(optimizer).__name__}> and the config\'s "optimizer" '
            "section: keep one of them"
        )
    for group_index, group in enumerate(optimizer.param_groups):
        for key, unused in _UNSUPPORTED.items():
            if bool(group.get(key, unused)) != unused:
                raise NotImplementedError(
                    f"initialize(optimizer=...): param group {group_index} sets {key}={group[key]!r}, which the "
                    f"engine's Adam does not do; build the optimizer with {key}={unused}"
                )
    decoupled = optimizer.defaults.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW)
    defaults = optimizer.defaults
    params = {
        "lr": float(defaults["lr"]),
        "betas": [float(b) for b in defaults["betas"]],
        "eps": float(defaults["eps"]),
        "weight_decay": float(defaults["weight_decay"]),
    }
    if decoupled:
        data["optimizer"] = {"type": "AdamW", "params": params}
    else:  # torch's Adam adds the decay to the gradient (L2): DeepSpeed's Adam with adam_w_mode false
        data["optimizer"] = {"type": "Adam", "params": {**params, "adam_w_mode": False}}
    groups = [
        {"params": list(group["params"]), **{k: group[k] for k in (*SETTINGS, *INFORMATIONAL) if k in group}}
        for group in optimizer.param_groups
    ]
    return data, groups


def _as_dict(config) -> dict:
    """A copy of the config as a dict, to add the optimizer section to."""
    if isinstance(config, Config):
        # As load_config re-reads a Config: the per-rank batch kept, the global one derived afresh.
        return {key: value for key, value in config.to_dict().items() if key != "train_batch_size"}
    if isinstance(config, (str, os.PathLike)):
        return read_config_file(os.fspath(config))
    return dict(config)
