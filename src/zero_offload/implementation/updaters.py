"""Updaters: *when* and *where* the optimizer runs, for states that say where the model states live.

The engine's step is the same for every configuration: reduce, check overflow, find the clip factor, then
`updater.update(grads, clip_factor, norms)`, then `states.publish()`. What differs is the updater:

  SerialUpdater       Adam over the whole partition at the step: on the device (stages 0-3), or on the host
                      after the copies (module 3's offload), on the host's own cores if the config pins them
  DevicePartUpdater   module 4 (tuning/partial.py): with a partial offload, the device's units after the host's
  OffloadPipeline     module 5 (practice/pipeline.py): each unit's Adam as its gradient arrives, overlapped
                      with the copies both ways
  NVMeUpdater         module 5 (practice/nvme.py): the partition read from files a sub-group at a time
  the delayed update  module 5 (practice/dpu.py): any of the host's updates, one step late

`norms`, when the engine passes a list, asks the updater to append each unit's squared gradient norm as its
Adam sums it (`norm_in_adam`: nothing to clip, so nothing needs the norm before Adam runs).
"""

from __future__ import annotations

import time

import torch

from .offload import HostAdam


class SerialUpdater:
    """Adam over the first `units` units at the step, one after the other (every unit when nothing is
    offloaded; the host's when module 4 keeps the others on the device). `queue`: the host's own cores."""

    def __init__(self, states, adam: HostAdam, units: int, *, timeline, queue=None, norm_in_adam=False):
        self.states, self.adam, self.units = states, adam, units
        self.timeline, self.queue, self.norm_in_adam = timeline, queue, norm_in_adam

    def update(self, grads: list[torch.Tensor], clip_factor: float, norms: list | None = None) -> float:
        """Adam over the units with their fp32 gradients; the seconds it took."""
        start = time.perf_counter()
        mine = grads[: self.units]
        if self.queue is not None:  # the device waits meanwhile
            self.queue.submit(self.adam.step, self.states, mine, clip_factor, norms=norms).wait()
        else:
            self.adam.step(self.states, mine, clip_factor, norms=norms)
        end = time.perf_counter()
        self.timeline.add("Adam", start, end)
        return end - start
