"""Updaters: *when* and *where* the optimizer runs, for states that say where the model states live.

The engine's step is the same for every configuration: reduce, check overflow, find the clip factor, then
`updater.update(grads, clip_factor, norms)`, then `states.publish(...)`. What differs is the updater:

  SerialUpdater       Adam over the whole partition at the step: on the device (stages 0-3), or on the host
                      after the copies (module 3's offload), on the host's own cores if the config pins them
  DevicePartUpdater   module 4 (tuning/partial.py): with a partial offload, the device's units after the host's
  OffloadPipeline     module 5 (practice/pipeline.py): each unit's Adam as its gradient arrives, overlapped
                      with the copies both ways
  NVMeUpdater         module 5 (practice/nvme.py): the partition read from files a sub-group at a time
  the delayed update  module 5 (practice/dpu.py): any of the host's updates, one step late

`norms`, when the engine passes a list, asks the updater to append each unit's squared gradient norm as its
Adam sums it (`norm_in_adam`: nothing to clip, so nothing needs the norm before Adam runs). Each returns an
`Update`: the seconds its Adam ran, and whether that Adam already rounded the weights publish() uploads.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .offload import HostAdam


class Update(NamedTuple):
    """What one updater's update() did, for the engine's report and for publish()."""

    seconds: float  # how long its Adam ran (the report's adam_seconds is the host's)
    # Its Adam wrote the rounded fp16/bf16 weights into the staging buffers (module 4's one pass):
    # publish(rounded=True) uploads them without rounding again.
    rounded: bool = False


class SerialUpdater:
    """Adam over the first `units` units at the step, one after the other (every unit when nothing is
    offloaded; the host's when module 4 keeps the others on the device). `queue`: the host's own cores."""

    def __init__(self, states, adam: HostAdam, units: int, *, timeline, queue=None, norm_in_adam=False):
        self.states, self.adam, self.units = states, adam, units
        self.timeline, self.queue, self.norm_in_adam = timeline, queue, norm_in_adam

    def update(self, grads: list[torch.Tensor], clip_factor: float, norms: list | None = None) -> Update:
        """Adam over the units with their fp32 gradients; the seconds it took, and whether it rounded."""
        mine = grads[: self.units]
        answers = []  # the queue's events carry no value: the Adam's answer comes back through this list

        def adam() -> None:
            answers.append(self.adam.step(self.states, mine, clip_factor, norms=norms))

        with self.timeline.adam() as clock:
            if self.queue is not None:  # the device waits meanwhile
                self.queue.submit(adam).wait()
            else:
                adam()
        return Update(clock.seconds, answers[0])
