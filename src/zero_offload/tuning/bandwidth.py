"""Probes: measure what the performance model (perfmodel.py) needs to know about this machine.

Four numbers decide how fast ZeRO-Offload trains ("GPU computes, CPU stores, PCIe moves"):

  host_copy_bandwidth()    how fast host memory copies, on several threads (one thread cannot saturate it);
  device_link_bandwidth()  how fast the device<->host link (PCIe) moves bytes, from pinned and from pageable
                           memory (CUDA only);
  cpu_adam_profile()       how many parameters a second our C Adam updates, what each call costs, and the
                           memory floor at the same threads (adam_probe.py);
  cache_profile()          how much faster it runs when its states stay in the last-level cache, and how
                           many bytes of states the cache keeps from one step to the next (cache_probe.py);
  matmul_tflops()          how fast the device multiplies matrices (the compute of forward and backward).

Each probe returns plain numbers (a small dataclass) and takes a second or less at its default size, less at
the small sizes tests use. Every timing is the median of several repeats: one slow repeat (another process,
a page fault) does not move a median.

The copy and matmul probes live here; the CPU Adam's in the two files named. This module hands those on too,
so that one name reaches every probe: hardware.calibrate calls them all as `bandwidth.<probe>`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adam_probe import (
    ADAM_FORMS,
    ENGINE_FORM,
    FLOOR_BYTES,
    FLUSH_BYTES,
    FORM_BYTES,
    STATE_BYTES,
    AdamProfile,
    cpu_adam_profile,
    cpu_adam_sweep,
    fit_adam_cost,
)
from .cache_probe import CacheProfile, cache_bytes_from_probes, cache_profile
from .cpu_adam import default_threads
from .timing import median_seconds

__all__ = [
    "ADAM_FORMS",
    "ENGINE_FORM",
    "FLOOR_BYTES",
    "FLUSH_BYTES",
    "FORM_BYTES",
    "STATE_BYTES",
    "AdamProfile",
    "Bandwidth",
    "CacheProfile",
    "LinkBandwidth",
    "cache_bytes_from_probes",
    "cache_profile",
    "cpu_adam_profile",
    "cpu_adam_sweep",
    "device_link_bandwidth",
    "fit_adam_cost",
    "host_copy_bandwidth",
    "matmul_tflops",
    "median_seconds",
]


@dataclass(frozen=True)
class Bandwidth:
    """`nbytes` copied in `seconds` (median). A copy reads and writes each byte: memory traffic is twice this."""

    nbytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9


def host_copy_bandwidth(
    nbytes: int = 64 * 2**20, repeats: int = 5, device="cpu", threads: int | None = None
) -> Bandwidth:
    """Host memory: one fp32 torch copy between two buffers of `nbytes` (use more than the last-level cache),
    on `threads` of torch's threads (default: as many as the engine's CPU Adam), as the emulated device copies.

    One thread cannot draw a host's whole memory bandwidth; calibrate() uses the memory floor of the C kernel
    where it has one. With a CUDA `device` the same copy measures the GPU's own memory (HBM) instead.
    """
    device = torch.device(device)
    source = torch.ones(nbytes // 4, device=device)
    target = torch.empty(nbytes // 4, device=device)

    def copy():
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    previous = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(threads or default_threads())
    try:
        return Bandwidth(source.nbytes, median_seconds(copy, repeats))
    finally:
        torch.set_num_threads(previous)


@dataclass(frozen=True)
class LinkBandwidth:
    """Device<->host copies in GB/s, from page-locked (pinned) and from ordinary (pageable) host memory."""

    h2d_pinned: float
    h2d_pageable: float
    d2h_pinned: float
    d2h_pageable: float

    @property
    def pinned(self) -> float:
        """The slower direction: ZeRO-Offload sends as many bytes down (gradients) as up (weights)."""
        return min(self.h2d_pinned, self.d2h_pinned)

    @property
    def pageable(self) -> float:
        return min(self.h2d_pageable, self.d2h_pageable)

    @property
    def pinned_speedup(self) -> float:
        return self.pinned / self.pageable


def device_link_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 5, device=None) -> LinkBandwidth:
    """PCIe (or NVLink-C2C) bandwidth of a CUDA device in each direction, pinned against pageable.

    A pageable copy goes through a pinned bounce buffer the driver keeps, one chunk at a time, and blocks the
    host; a pinned copy is one DMA transfer. Raises RuntimeError where there is no CUDA device.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "device_link_bandwidth needs a CUDA device and torch sees none; on the emulated device a "
            "'transfer' is a host memory copy: use host_copy_bandwidth()"
        )
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    results = {}
    for pin in (True, False):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        kind = "pinned" if pin else "pageable"
        for name, dst, src in (("h2d", on_device, host), ("d2h", host, on_device)):

            def copy(dst=dst, src=src, pin=pin):
                dst.copy_(src, non_blocking=pin)
                torch.cuda.synchronize(device)  # count the whole transfer, not only its launch

            results[f"{name}_{kind}"] = Bandwidth(nbytes, median_seconds(copy, repeats)).gb_per_s
    return LinkBandwidth(**results)


def matmul_tflops(device=None, dtype: torch.dtype | None = None, size: int = 1024, repeats: int = 5) -> float:
    """Dense matmul speed in TFLOP/s (2 n^3 FLOPs per n x n product): fp16 on CUDA, fp32 on the CPU."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def product():
        torch.mm(a, b)
        sync()

    return 2 * size**3 / median_seconds(product, repeats) / 1e12
