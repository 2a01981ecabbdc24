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

import torch
from torch.utils.checkpoint import checkpoint


def checkpoint_blocks(model: torch.nn.Module, accelerator, storage_dtype: torch.dtype) -> int:
    """Wrap each repeated block's forward so that it is recomputed in backward; returns how many were wrapped."""
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

    def run(*args):
        # In forward (gradients off inside the checkpoint) nothing is saved. In backward the block runs again
        # with gradients on, and what it saves is real device memory until its backward is done: charge it.
        charge = (
            accelerator.activations(storage_dtype) if torch.is_grad_enabled() else contextlib.nullcontext()
        )
        with charge:
            return forward(*args)

    def checkpointed(*args):
        if not torch.is_grad_enabled():
            return forward(*args)
        # The reentrant variant saves the block's inputs with save_for_backward, under the engine's
        # saved-tensor hooks: the inputs it keeps are charged to the device like any activation.
        return checkpoint(run, *args, use_reentrant=True)

    block.forward = checkpointed
