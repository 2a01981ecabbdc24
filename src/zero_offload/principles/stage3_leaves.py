"""ZeRO-3 leaf modules, and what stage 3 says when the ranks' passes part ways.

Every stage-3 gather is a collective: rank r's shard of a unit travels to every other rank, so all ranks must
gather the same unit at the same turn. A model whose ranks run different modules breaks that: in a mixture of
experts, rank 0's tokens may go to expert 0 only and rank 1's to expert 1 only, and then rank 0 gathers expert 0
while rank 1 gathers expert 1. The collective pairs them up anyway, and each rank would compute with weights
made of two experts' shards.

Two things keep that from training anything:
- before each gather the ranks compare which unit they are about to gather (one small all-gather of the unit's
  number, stage3_gather.py); at the first difference every rank raises `GatherOrderError`, which says which
  modules differ and which module to declare a leaf;
- a *leaf module* (DeepSpeed's name and config key: `zero_optimization.leaf_module`) is gathered whole: when
  it is entered, every unit in its subtree is gathered, in the same order on every rank, whichever of its
  children the rank's data then runs. The modules inside a leaf gather nothing of their own.
"""

from __future__ import annotations

import torch

from ..config.schema import DEFAULT_LEAF_CLASSES


def _class_names(module: torch.nn.Module) -> set[str]:
    cls = type(module)
    return {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}


def find_leaf_modules(model: torch.nn.Module, leaf_config) -> set[torch.nn.Module]:
    """The modules of `model` that `leaf_config` (config.schema.LeafModuleConfig) names, or that DeepSpeed's
    `set_z3_leaf_modules` flagged (`_z3_leaf`). A class or name the user wrote that matches nothing is an error:
    a misspelt leaf would otherwise leave the model exposed to the very mismatch it was meant to prevent."""
    classes, names, suffixes = set(leaf_config.classes), set(leaf_config.names), leaf_config.name_suffixes
    found, matched = set(), set()
    for name, module in model.named_modules():
        hits = (_class_names(module) & classes) | ({name} & names)
        hits |= {s for s in suffixes if name.endswith(s)}
        if hits or getattr(module, "_z3_leaf", False):
            found.add(module)
            matched |= hits
    chosen = {"classes": classes - set(DEFAULT_LEAF_CLASSES), "names": names, "name_suffixes": set(suffixes)}
    for key, wanted in chosen.items():
        missing = sorted(wanted - matched)
        if missing:
            raise ValueError(
                f"zero_optimization.leaf_module.{key}: {', '.join(map(repr, missing))} matches no module of "
                f"the model; the modules are named as in model.named_modules() (e.g. "
                f"{_examples(model)}) and classes by their class name"
            )
    return found


def _examples(model: torch.nn.Module) -> str:
    named = [f"{name!r} ({type(m).__name__})" for name, m in model.named_modules() if name][:4]
    return ", ".join(named) or "the model has no submodules"


class GatherOrderError(RuntimeError):
    """At stage 3 the ranks were about to gather different units at the same turn; raised on every rank, before
    the mismatched collective and before any weight is updated."""


def order_problem(phase: str, wanted: list[int], units, running: list[torch.nn.Module], model_names) -> str:
    """The message for GatherOrderError. `wanted[r]`: the unit rank r was about to gather (-1: it had reached
    the end of its pass); `running`: this rank's modules whose forward was running, outermost first;
    `model_names`: module -> its name in named_modules()."""

    def what(index: int) -> str:
        if index < 0:
            return f"had finished its {phase} pass"
        unit = units[index]
        return f"gathers module '{unit.name}' ({len(unit.params)} parameter(s), {unit.numel} elements)"

    ranks = "; ".join(f"rank {rank} {what(index)}" for rank, index in enumerate(wanted))
    return (
        f"ZeRO stage 3: the ranks' {phase} passes part ways: {ranks}. Each stage-3 gather is a collective that "
        "every rank joins in the same order, so every rank must run the same modules the same number of times. "
        "A module whose children run on some ranks only (mixture-of-experts routing, a data-dependent branch) "
        f"must be gathered whole: declare it a leaf, {_leaf_hint(wanted, units, running, model_names)}; or train "
        "at stage 2, which gathers no weights. Nothing has been updated by this step."
    )


def _leaf_hint(wanted, units, running, model_names) -> str:
    """The innermost module running here whose subtree holds every unit involved: the one to make a leaf."""
    involved = {units[i].name for i in wanted if i >= 0}
    for module in reversed(running):
        name = model_names.get(module, "")
        if not name or all(n == name or n.startswith(f"{name}.") for n in involved):
            if name:
                return f'e.g. "zero_optimization": {{"leaf_module": {{"names": ["{name}"]}}}}'
            return f'e.g. "zero_optimization": {{"leaf_module": {{"classes": ["{type(module).__name__}"]}}}}'
    return '"zero_optimization": {"leaf_module": {"names": [...]}} (or "classes": [...])'
