"""DPU with module 5's pipeline: the delayed update's new weights go up during the next backward.

OffloadPipeline (pipeline.py) inherits this. With the delayed update (dpu.py) the host's Adam of step t runs
while step t+1 computes; instead of uploading every weight at the step, each unit's new weights go up as soon
as the next backward is done with that unit, so the uploads overlap backward too.
"""

from __future__ import annotations

from ..accelerator.streams import Event


class EarlyUploads:
    """The uploads of the delayed update's weights, queued during backward, for OffloadPipeline (which
    provides `states`, the `upload` stream, `_upload`, and the `early` and `_early_after` it initialises)."""

    def upload_during_backward(self, update: Event) -> None:
        """`update` (the delayed Adam just launched, module 4's C Adam: it rounds into param_staging itself)
        rewrites every host unit's weights. Once the next backward is done with a unit, nothing reads that
        unit's weights before the next forward, so its new ones may go up then instead of at the step."""
        self._early_after = update

    def _upload_early(self, index: int) -> None:
        # Every unit delivered is a host unit whose weights live on the device: DPU is refused with a partial
        # offload and with offload_param (config/rules.py).
        self.upload.wait_event(self._early_after)  # the weights exist once the whole update has run
        self.early[index] = self._upload(index, self.states.param_staging[index])

    def take_early_uploads(self) -> set[int]:
        """Wait for the uploads queued during backward and forget them; the units they covered."""
        early, self.early, self._early_after = self.early, {}, None
        for event in early.values():
            event.wait()
        return set(early)
