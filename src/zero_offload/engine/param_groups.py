"""Parameter groups: which of the model's parameters Adam updates with which lr, betas, eps and weight_decay.

A script gives them as torch.optim and DeepSpeed take them, a list of dicts such as
`[{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]`; a key a group leaves
out takes the value of the config's "optimizer" section. Every trainable parameter of the model is in exactly
one group (frozen ones may be listed: nothing trains them).

ZeRO flattens each module's parameters into one unit (principles/partition.py). A module whose parameters fall
in two groups (a Linear's weight decays, its bias does not) becomes one unit per group, so that every fp32
master piece the optimizer updates belongs to one group, and its optimizer group is a plain torch one.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

SETTINGS = ("lr", "betas", "eps", "weight_decay")  # what a group may set for itself
INFORMATIONAL = ("name",)  # accepted and kept, as scripts label their groups; the engine does not read it


@dataclass(frozen=True)
class ParamGroups:
    """The resolved groups: each one's settings, and the group of every trainable parameter."""

    settings: tuple[dict, ...]  # per group: lr, betas, eps, weight_decay (and a "name", where given)
    group_of: dict[int, int]  # id(param) -> the index of its group

    @property
    def count(self) -> int:
        return len(self.settings)

    def unit_groups(self) -> dict[int, int] | None:
        """What build_units splits the modules by: None while there is one group (a unit per module)."""
        return self.group_of if self.count > 1 else None

    def torch_groups(self, masters: list[torch.Tensor], master_groups: list[int]) -> list[dict]:
        """The optimizer's param groups over the fp32 `masters` (the group of each in `master_groups`), in the
        script's order; a group with no piece here (partial offload: all on the other side) stays, empty."""
        return [
            {"params": [m for m, g in zip(masters, master_groups, strict=True) if g == index], **settings}
            for index, settings in enumerate(self.settings)
        ]

    def names(self, model: torch.nn.Module) -> list[list[str]]:
        """Each group's trainable parameters by name, as a checkpoint records them."""
        named = [[] for _ in self.settings]
        for name, param in model.named_parameters():
            if id(param) in self.group_of:
                named[self.group_of[id(param)]].append(name)
        return named


def group_fingerprint(groups: ParamGroups, model: torch.nn.Module) -> str:
    """A digest of the groups (settings and members), the same on every rank that built the same groups."""
    listing = [
        (sorted(settings.items()), names)
        for settings, names in zip(groups.settings, groups.names(model), strict=True)
    ]
    return hashlib.sha256(repr(listing).encode()).hexdigest()


def default_settings(optimizer) -> dict:
    """The config's optimizer values (config.OptimizerConfig), which a group's missing keys take."""
    return {
        "lr": optimizer.lr,
        "betas": tuple(optimizer.betas),
        "eps": optimizer.eps,
        "weight_decay": optimizer.weight_decay,
    }


def resolve_param_groups(model: torch.nn.Module, groups, optimizer) -> ParamGroups:
    """The groups of `groups` (None, parameters, or a list of dicts) over `model`'s trainable parameters,
    settings not given taken from `optimizer` (the config's); a clear error for anything else."""
    trained = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    defaults = default_settings(optimizer)
    given = None if groups is None else list(groups)
    if not given or not any(isinstance(item, dict) for item in given):
        _check_flat(model, given, trained)
        return ParamGroups((defaults,), dict.fromkeys(trained, 0))
    if not all(isinstance(item, dict) for item in given):
        raise TypeError(
            "model_parameters mixes parameter groups (dicts) with bare tensors; put every tensor in a group: "
            '[{"params": [...], "weight_decay": 0.0}, ...]'
        )
    settings, group_of = [], {}
    all_names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    for index, group in enumerate(given):
        settings.append({**defaults, **_checked_settings(index, group)})
        for param in _group_params(index, group):
            if id(param) not in all_names:
                raise ValueError(
                    f"parameter group {index} holds a tensor of shape {tuple(param.shape)} that is not a "
                    "parameter of the model; build the groups from model.named_parameters()"
                )
            if id(param) not in trained:
                continue  # frozen: nothing trains it, as torch.optim skips a parameter without a gradient
            if id(param) in group_of:
                raise ValueError(
                    f"parameter {trained[id(param)]!r} is in parameter groups {group_of[id(param)]} and {index}; "
                    "put each parameter in one group"
                )
            group_of[id(param)] = index
    missing = [name for key, name in trained.items() if key not in group_of]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        raise ValueError(
            f"{len(missing)} trainable parameter(s) of the model are in no parameter group: {shown}; add them to a "
            "group, or set requires_grad=False on those that must not train"
        )
    return ParamGroups(tuple(settings), group_of)


def _check_flat(model: torch.nn.Module, given: list | None, trained: dict) -> None:
    """Plain parameters (no groups): the engine trains exactly the model's trainable parameters."""
    if given is None:
        return
    ids = {id(p) for p in given}
    if ids != set(trained):
        missing, foreign = len(set(trained) - ids), len(ids - set(trained))
        raise ValueError(
            f"model_parameters leaves out {missing} trainable parameter(s) of the model and adds {foreign} that "
            "it does not train; the engine trains exactly the model's parameters with requires_grad: set "
            "requires_grad=False on those it must not train, and pass model.parameters() or parameter groups"
        )


def group_tensors(group: dict) -> list:
    """What a torch-style group's "params" lists: one tensor, or an iterable of them (unchecked)."""
    params = group.get("params", [])
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _group_params(index: int, group: dict) -> list[torch.Tensor]:
    if "params" not in group:
        raise ValueError(f'parameter group {index} has no "params": give it {{"params": [...], ...}}')
    params = group_tensors(group)
    for param in params:
        if not isinstance(param, torch.Tensor):
            raise TypeError(
                f"parameter group {index} holds a {type(param).__name__}, not a parameter; pass the tensors "
                "(model.named_parameters() gives (name, tensor) pairs: keep the tensor)"
            )
    return params


def _checked_settings(index: int, group: dict) -> dict:
    """The settings `group` gives itself, checked as the config's optimizer section checks its own."""
    unknown = sorted(set(group) - {"params", *SETTINGS, *INFORMATIONAL})
    if unknown:
        raise ValueError(
            f"parameter group {index} sets {', '.join(unknown)}, which the engine's Adam does not take per "
            f"group; a group may set {', '.join(SETTINGS)} (the rest is the config's optimizer section)"
        )
    own = {key: group[key] for key in (*SETTINGS, *INFORMATIONAL) if key in group}
    problem = None
    if "lr" in own and not (_number(own["lr"]) and own["lr"] >= 0):
        problem = f"lr must be a number >= 0, got {own['lr']!r}"
    elif "eps" in own and not (_number(own["eps"]) and own["eps"] > 0):
        problem = f"eps must be a number > 0, got {own['eps']!r}"
    elif "weight_decay" in own and not (_number(own["weight_decay"]) and own["weight_decay"] >= 0):
        problem = f"weight_decay must be a number >= 0, got {own['weight_decay']!r}"
    elif "betas" in own and not _betas(own["betas"]):
        problem = f"betas must be two numbers in [0, 1), got {own['betas']!r}"
    if problem:
        raise ValueError(f"parameter group {index}: {problem}")
    if "betas" in own:
        own["betas"] = tuple(float(b) for b in own["betas"])
    for key in ("lr", "eps", "weight_decay"):
        if key in own:
            own[key] = float(own[key])
    return own


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _betas(value) -> bool:
    return (
        isinstance(value, (list, tuple)) and len(value) == 2 and all(_number(b) and 0 <= b < 1 for b in value)
    )
