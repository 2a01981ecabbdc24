"""Activation recomputation (checkpointing): keep each transformer block's input, recompute the rest in backward.

Without it, backward needs every activation forward produced: for our block about 2 * (16 L + 2) * b * s * h
bytes in fp16 (chapter 01). With it, forward keeps only each block's input (b * s * h values per block) and
backward runs the block's forward once more, just before its backward, holding one block's activations at a
time. Memory goes from O(layers x block) to O(layers + block); the price is one extra forward, about a third
more compute per step.

The engine applies it when the config has DeepSpeed's "activation_checkpointing" section: every child of every
nn.ModuleList (the repeated blocks) is checkpointed.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.utils.checkpoint import checkpoint


def checkpoint_blocks(model: torch.nn.Module, accelerator, storage_dtype: torch.dtype) -> int:
    """Wrap each repeated block's forward so that it is recomputed in backward; returns how many were wrapped."""
    config = getattr(model, "config", None)  # a Hugging Face model's
    if getattr(config, "use_cache", False):
        # A block run again in backward would append its keys and values to the cache a second time, and
        # attend over both copies: the gradients of the key and value projections come out wrong (zero).
        warnings.warn(
            "activation_checkpointing: setting the model's config.use_cache to False (a recomputed block "
            "would fill its key/value cache twice); generation can turn it back on",
            stacklevel=3,
        )
        config.use_cache = False
    wrapped = 0
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                _wrap(block, accelerator, storage_dtype)
                wrapped += 1
    if wrapped == 0:
        raise ValueError(
            "activation_checkpointing: the model has no nn.ModuleList of blocks to checkpoint; "
            "keep its repeated layers in an nn.ModuleList, or remove the activation_checkpointing section"
        )
    return wrapped


def _wrap(block: torch.nn.Module, accelerator, storage_dtype: torch.dtype) -> None:
    forward = block.forward

    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        names = list(kwargs)  # Hugging Face calls its blocks with keywords (attention_mask=..., ...)

        def run(*flat):
            # In forward (gradients off inside the checkpoint) nothing is saved. In backward the block runs
            # again with gradients on, and what it saves is real device memory until its backward is done.
            charge = (
                accelerator.activations(storage_dtype)
                if torch.is_grad_enabled()
                else contextlib.nullcontext()
            )
            with charge:
                return forward(*flat[: len(args)], **dict(zip(names, flat[len(args) :], strict=True)))

        flat = (*args, *kwargs.values())
        if any(_nested_tensor_needs_grad(value) for value in flat):
            # The reentrant variant passes a tensor inside a tuple through as a constant: its gradient would be
            # lost. The other variant follows it, but keeps the block's inputs outside the saved-tensor hooks.
            return checkpoint(run, *flat, use_reentrant=False)
        # The reentrant variant saves the block's inputs with save_for_backward, under the engine's
        # saved-tensor hooks: the inputs it keeps are charged to the device like any activation.
        return checkpoint(run, *flat, use_reentrant=True)

    block.forward = checkpointed


def _nested_tensor_needs_grad(value) -> bool:
    if isinstance(value, (list, tuple)):
        return any(
            isinstance(v, torch.Tensor) and v.requires_grad or _nested_tensor_needs_grad(v) for v in value
        )
    if isinstance(value, dict):
        return _nested_tensor_needs_grad(list(value.values()))
    return False
