"""`deepspeed.zero.GatheredParameters`: the full weights of stage-3 parameters for the length of a block."""

from __future__ import annotations

import contextlib

import torch

from ..engine.engine import engine_of


@contextlib.contextmanager
def GatheredParameters(params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):  # noqa: N802
    """DeepSpeed's name for `engine.gathered_parameters(params, modifier_rank=...)`: every rank enters it; with
    `modifier_rank=r`, what rank r writes into the weights becomes every rank's weights and fp32 masters.

    `params` are parameters of a model an engine trains (a single one, or any iterable of them); the engine is
    found from them. `fwd_module` (DeepSpeed registers external parameters with it) has no counterpart here."""
    if fwd_module is not None:
        raise TypeError(
            "GatheredParameters(fwd_module=...) registers external parameters in DeepSpeed; this engine gathers a "
            "module's parameters wherever they are read: drop the argument"
        )
    if not enabled:
        yield
        return
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    with engine_of(params).gathered_parameters(params, modifier_rank=modifier_rank):
        yield
