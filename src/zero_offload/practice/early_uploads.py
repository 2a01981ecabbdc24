"""DPU with module 5's pipeline: the delayed update's new weights go up during the next backward.

OffloadPipeline (pipeline.py) owns one `EarlyUploads`. With the delayed update (dpu.py) the host's Adam of step t
runs while step t+1 computes; instead of uploading every weight at the step, each unit's new weights go up as
soon as the next backward is done with that unit, so the uploads overlap backward too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..accelerator.streams import Event


class EarlyUploads:
    """The uploads of the delayed update's weights, queued during backward: from `sources` (the host's staging
    buffers, one per host unit, that the delayed Adam rounds into) into `targets` (the units' device shards),
    by `to_device(dst, src, blocking=...)` (Transfers.to_device)."""

    def __init__(self, sources: list[torch.Tensor], targets: list[torch.Tensor], to_device: Callable):
        self.sources, self.targets, self.to_device = sources, targets, to_device
        # The delayed Adam in flight, whose weights may go up early.
        self.update: Event | None = None
        # Unit -> the upload of its new weights, queued during backward.
        self.queued: dict[int, Event] = {}

    def start(self, update: Event) -> None:
        """`update` (the delayed Adam just launched, module 4's C Adam: it rounds into `sources` itself)
        rewrites every host unit's weights. Once the next backward is done with a unit, nothing reads that
        unit's weights before the next forward, so its new ones may go up then instead of at the step."""
        self.update = update

    def upload(self, index: int, stream) -> None:
        """Unit `index`'s new weights up on `stream`, behind the whole update (the weights exist once it has run).
        Every unit handed here is a host unit whose weights live on the device: DPU is refused with a partial
        offload and with offload_param (config/rules.py)."""
        stream.wait_event(self.update)
        target, source = self.targets[index], self.sources[index]
        self.queued[index] = stream.submit(self.to_device, target, source, blocking=False)

    def take(self) -> set[int]:
        """Wait for the uploads queued during backward and forget them; the units they covered."""
        queued, self.queued, self.update = self.queued, {}, None
        for event in queued.values():
            event.wait()
        return set(queued)
