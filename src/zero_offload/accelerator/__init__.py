"""One interface for device work: a real CUDA GPU, or an emulated device on the CPU.

Every device operation of the engine goes through an `Accelerator`: allocating device buffers, host buffers
(pinned when CUDA exists), streams and events, and memory statistics. The emulated device lets a laptop run the
same code as a GPU server: its "device" tensors live in host memory, but every byte placed on the device is charged
to a budget, and going over it raises an out-of-memory error that reads like CUDA's.

Choosing: CUDA when it is available, unless `ZO_DEVICE=cpu`; `ZO_DEVICE=cuda` insists on CUDA.
Budget: the config's `"zero_offload": {"device_memory": "512MB"}`, else `ZO_DEVICE_MEMORY`, else unlimited.

The files:
  base.py            `Accelerator`, `MemoryStats`, the memory categories and the out-of-memory hints
  emulated.py        `EmulatedAccelerator`: the budget's books, storage freed and restored, copies on a link queue
  saved_tensors.py   the saved-tensor hooks that charge activations to the emulated device
  host_allocator.py  `keep_freed_blocks`: glibc's malloc told to keep freed blocks, as a GPU's allocator does;
                     `pageable_empty`: a large host buffer on 2 MiB pages of its own, its start staggered;
                     `pinned_plan`: how a pinned host buffer is made and how many bytes it locks
  cuda.py            `CudaAccelerator`
  streams.py         streams and events: a CUDA stream, or a worker thread that runs its queue in order
  __init__.py        `get_accelerator` and `wants_cuda`: which one this process gets
"""

from __future__ import annotations

import os

import torch

from ..units import parse_bytes
from .base import (
    CATEGORIES,
    OFFLOAD_HINTS,
    Accelerator,
    DeviceOutOfMemoryError,
    HintOnOutOfMemory,
    MemoryStats,
    hinted_oom,
    offload_hint,
)
from .cuda import CudaAccelerator
from .emulated import EmulatedAccelerator
from .host_allocator import keep_freed_blocks

__all__ = [
    "CATEGORIES",
    "OFFLOAD_HINTS",
    "Accelerator",
    "CudaAccelerator",
    "DeviceOutOfMemoryError",
    "EmulatedAccelerator",
    "HintOnOutOfMemory",
    "MemoryStats",
    "get_accelerator",
    "hinted_oom",
    "keep_freed_blocks",
    "offload_hint",
    "wants_cuda",
]


def wants_cuda() -> bool:
    """Whether `get_accelerator()` chooses CUDA: `ZO_DEVICE` says so, or it is unset and torch sees a GPU."""
    choice = os.environ.get("ZO_DEVICE", "").strip().lower()
    if choice not in ("", "cuda", "cpu"):
        raise ValueError(f"ZO_DEVICE={choice!r} is not understood; use ZO_DEVICE=cuda or ZO_DEVICE=cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "ZO_DEVICE=cuda but torch sees no CUDA device; unset ZO_DEVICE to use the emulated one"
        )
    return choice != "cpu" and torch.cuda.is_available()


def get_accelerator(device_memory: int | str | None = None) -> Accelerator:
    """The accelerator for this process: CUDA if present (or `ZO_DEVICE=cuda`), else the emulated device."""
    cuda = wants_cuda()
    if device_memory is None and os.environ.get("ZO_DEVICE_MEMORY"):
        try:
            device_memory = parse_bytes(os.environ["ZO_DEVICE_MEMORY"])
        except ValueError as err:
            raise ValueError(f"ZO_DEVICE_MEMORY: {err}") from None
    capacity = None if device_memory is None else parse_bytes(device_memory)
    if cuda:
        return CudaAccelerator(capacity)
    return EmulatedAccelerator(capacity)
