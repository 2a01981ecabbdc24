"""Every copy between the device and the host, counted; and the host buffers the copies go through.

The two sides of a copy must have the same dtype: casting happens on one side before or after the copy, never
in the copy itself, so the bytes counted are the bytes the link (PCIe) really carries. Host buffers are pinned
(page-locked) when the config asks, so that DMA can read them, with a pageable fallback where pinning fails.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter

import torch

from ..accelerator import Accelerator


class Transfers:
    """Every copy between device and host goes through here, so the bytes on the link are counted.

    The two sides must have the same dtype: casting is done on one side before or after the copy, never by
    the copy itself, so the count is the traffic the link really carries.
    """

    def __init__(self, accel: Accelerator, *, timeline=None):
        self.accel = accel
        self.bytes: Counter[str] = Counter()  # "d2h" and "h2d"
        self.timeline = timeline  # module 5's practice.timeline.Timeline, when the engine keeps one
        self._lock = threading.Lock()

    def _check(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> None:
        if dst.dtype != src.dtype or dst.numel() != src.numel():
            raise ValueError(
                f"{direction} copy of {src.numel()} {src.dtype} elements into {dst.numel()} {dst.dtype}: "
                "sizes and dtypes must match; cast on one side first (only fp16/bf16 should cross the link)"
            )
        src_on, dst_on = self.accel.is_on_device(src), self.accel.is_on_device(dst)
        if (direction == "d2h" and (not src_on or dst_on)) or (direction == "h2d" and (src_on or not dst_on)):
            where = {True: "device", False: "host"}
            raise ValueError(
                f"a {direction} copy goes from {where[src_on]} to {where[dst_on]} memory; "
                "check which buffer is the source"
            )

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, *, blocking: bool = True) -> None:
        """Copy `src` (device) into `dst` (host). Blocking by default, because the CPU reads `dst` right after;
        module 5's pipeline passes blocking=False and waits for its down stream's event instead."""
        self._check(dst, src, "d2h")
        start = self._mark("D2H")
        self.accel.copy_(dst, src, non_blocking=not blocking)
        self._count("d2h", "D2H", src, start)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, *, blocking: bool = False) -> None:
        """Copy `src` (host) into `dst` (device). From pinned memory the copy runs by DMA while the CPU goes on;
        the device's stream orders it before any kernel that reads `dst`."""
        self._check(dst, src, "h2d")
        start = self._mark("H2D")
        self.accel.copy_(dst, src, non_blocking=not blocking)
        self._count("h2d", "H2D", src, start)

    def _mark(self, stage: str):
        # On CUDA the timeline marks the copy's stream, so a non-blocking copy's span is the DMA, not its launch.
        return self.timeline.mark(stage) if self.timeline is not None else None

    def _count(
        self, direction: str, stage: str, src: torch.Tensor, start: float | torch.cuda.Event | None
    ) -> None:
        # The pipeline copies on its own thread while the main thread may copy too (stage 3 gathers).
        with self._lock:
            self.bytes[direction] += src.numel() * src.element_size()
        if self.timeline is not None and start is not None:
            self.timeline.finish(stage, start)

    def reset(self) -> None:
        self.bytes.clear()


def host_buffer(
    accel: Accelerator, numel: int, dtype: torch.dtype, *, pin: bool, zeroed: bool = True
) -> torch.Tensor:
    """A host buffer (zeroed unless told not to), page-locked if `pin` (so DMA can read it); pageable, with a
    warning, if the pinning fails."""
    try:
        buffer = accel.host_empty(numel, dtype, pin=pin)
        return buffer.zero_() if zeroed else buffer
    except RuntimeError as err:  # pinned memory is limited (ulimit -l, containers)
        # One text for every buffer, so that the warnings filter shows it once, not once per buffer.
        warnings.warn(
            f"could not pin host memory ({err}); using pageable memory, which makes every copy go through a "
            'bounce buffer. Set "pin_memory": false to silence this, or raise the locked-memory limit.',
            stacklevel=3,
        )
        return torch.zeros(numel, dtype=dtype)
