"""Delayed parameter update (DPU): the CPU's Adam of step t runs during the forward and backward of step t+1.

With a small batch the device's forward and backward are short and the CPU's Adam is long; even overlapped
with the copies (pipeline.py) the device waits for it at every step. The ZeRO-Offload paper's answer is to
let the update lag by one step:

    step t     backward(t) -> gradients g_t to the host -> launch Adam(g_t) on the host, do not wait
    step t+1   forward/backward(t+1) on the weights of step t-1's update, while Adam(g_t) runs
               -> wait for Adam(g_t), publish its weights, launch Adam(g_t+1)

so the gradient applied at step t+1 was computed on weights one update old: w_t+2 = Adam(w_t+1, grad(w_t)).
The first `start_step` steps run synchronously, because early updates are large and a stale gradient hurts
most then (the paper turns DPU on after a few dozen steps). Adam reads a snapshot of the gradients, since the
next backward may write the live buffer while Adam runs. Module 5's pipeline needs none: there every write of the
host's gradients is a task on the host queue, queued behind Adam, so Adam may read them where they are.

Publishing is itself asynchronous: on a GPU the uploads of the new weights are DMA copies from pinned host memory
that are still running when `publish()` returns, and the next Adam rewrites exactly what they read (the fp32
master, or the fp16 staging buffer the one-pass Adam rounds into). So Adam is queued behind the event of those
uploads: the host waits for the link, never the device for the host.

Anything that must see the newest weights (`engine.synchronize()`, reading the whole model) calls `finish`: it
waits and publishes, so forward reads that update one step earlier than it would have. A checkpoint must not
change the run, neither the one that saves nor the one that resumes: it calls `land`, which waits for the
update in flight but leaves its publish to the next step, and saves the landed fp32 masters and moments along
with the weights forward reads (one update old) and a flag that a publish is pending
(implementation/checkpoint_format.py). Loading publishes the saved weights, puts the landed masters back, and
`hold_landed` leaves their publish to the next step, lr-scheduler step included, exactly as in the run that
saved.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..accelerator.streams import Event


class DelayedUpdate:
    """Keeps at most one update in flight on the host queue."""

    def __init__(self, host, start_step: int, *, copy_gradients: bool = True):
        self.host, self.start_step = host, start_step
        # False only when nothing can write the gradients before the update in flight has read them.
        self.copy_gradients = copy_gradients
        self.in_flight: Event | None = None
        self.snapshot: list[torch.Tensor] | None = None  # the gradients the update in flight reads
        self.uploads: Event | None = None  # the last publish's uploads, which read what Adam writes

    def active(self, step: int) -> bool:
        return step >= self.start_step

    def step(self, grads: list[torch.Tensor], adam: Callable[[list[torch.Tensor]], None],
             publish: Callable[[], Event | None], *, skip: bool) -> None:  # fmt: skip
        """One optimizer step under DPU: finish the previous update, then launch `adam` on this one's gradients.

        `adam(snapshot)` updates the host's fp32 masters from the gradient tensors it is given; `publish()`
        puts the updated weights where forward reads them and returns the event of its uploads (None if it
        uploads nothing); `skip` is true for a step with an fp16 overflow."""
        # BEGIN LAB 5.3: the delayed parameter update
        # 1. Finish the previous step's update first: self.finish(publish) waits for it and publishes its
        #    weights (forward t+1 must read them, and Adam must not run twice at once on the same masters).
        # 2. Unless `skip`: if self.copy_gradients, copy `grads` into self.snapshot (allocate it on first use:
        #    one torch.empty_like per gradient tensor), because the next backward may write `grads` while Adam
        #    runs, and give Adam the snapshot; otherwise give it `grads` themselves.
        # 3. The uploads that publish started may still be reading the host buffers Adam rewrites: if
        #    self.uploads is not None, make the host queue wait for it (self.host.wait_event(...)). Then launch
        #    Adam without waiting: self.in_flight = self.host.submit(adam, <the snapshot or grads>).
        self.finish(publish)
        if skip:
            return
        if self.copy_gradients:
            if self.snapshot is None:
                self.snapshot = [torch.empty_like(g) for g in grads]
            for saved, grad in zip(self.snapshot, grads, strict=True):
                saved.copy_(grad)
            grads = self.snapshot
        if self.uploads is not None:
            self.host.wait_event(self.uploads)
        self.in_flight = self.host.submit(adam, grads)
        # END LAB 5.3

    def finish(self, publish: Callable[[], Event | None]) -> bool:
        """Wait for the update in flight and publish it; True if there was one."""
        if self.in_flight is None:
            return False
        event, self.in_flight = self.in_flight, None
        event.wait()
        self.uploads = publish()
        return True

    def land(self) -> bool:
        """Wait for the update in flight, but leave it for the next step to publish; True if there is one."""
        if self.in_flight is None:
            return False
        self.in_flight.wait()
        return True

    def hold_landed(self) -> None:
        """An update that has already landed (restored from a checkpoint) is the next step's to publish."""
        self.in_flight = Event()  # done: nothing to wait for


class DelayedUpdater:
    """The delayed update as the engine runs it: each step lands the previous step's Adam, publishes it, then
    launches this step's Adam (`host_adam` over the whole host partition) on the host queue."""

    def __init__(self, update: DelayedUpdate, states, host_adam, *, accel, timeline, pipeline=None,
                 lr_scheduler=None):  # fmt: skip
        self.update, self.states, self.host_adam = update, states, host_adam
        self.accel, self.timeline, self.pipeline, self.lr_scheduler = accel, timeline, pipeline, lr_scheduler
        # What the host Adam in flight answered: it already rounded the weights publish() uploads (module 4).
        self.rounded = False

    def active(self, step: int) -> bool:
        return self.update.active(step)

    def gradients(self, inv_scale: float) -> list[torch.Tensor]:
        """What this step's Adam reads: the pipeline's kept gradients (host_gradients.py) where it keeps them,
        else the states' fp32 gradients."""
        if self.pipeline is not None and self.pipeline.keeping:
            return self.pipeline.kept_gradients()
        return self.states.fp32_gradients(inv_scale)

    def step(self, grads: list[torch.Tensor], clip_factor: float, *, skip: bool) -> None:
        states, host_adam, timeline = self.states, self.host_adam, self.timeline

        def adam(snapshot):  # runs on the host queue while forward and backward of the next step run
            with timeline.adam():  # the whole partition is the host's: DPU refuses a partial offload
                self.rounded = host_adam.step(states, snapshot, clip_factor)

        self.update.step(grads, adam, self.publish, skip=skip)
        pipeline, in_flight = self.pipeline, self.update.in_flight
        # Early uploads wait for the host's Adam on the up stream: only where that does not block backward,
        # and only where that Adam rounds into the staging buffers itself.
        early = pipeline is not None and host_adam.rounds_in_pass and pipeline.up.waits_without_blocking
        if early and in_flight is not None:
            pipeline.upload_during_backward(in_flight)

    def publish(self) -> Event:
        """Publish the update that has landed; the event of its uploads, which read what the next Adam writes."""
        rounded, self.rounded = self.rounded, False
        # With the pipeline, but for the units whose weights went up during backward.
        self.states.publish(rounded=rounded)
        if self.lr_scheduler is not None:  # the update that just landed read the old rate: move on now
            self.lr_scheduler.step()
        return self.accel.record_event()

    def synchronize(self) -> None:
        """Land the update in flight and publish it, with its uploads done before the caller goes on."""
        self.update.finish(self.publish)
        self.accel.fence_copies()

    def land(self) -> bool:
        """Wait for the update in flight without publishing it; True if its publish is still to come."""
        return self.update.land()

    def hold_landed(self) -> None:
        """The masters hold an update that has landed: the next step publishes it (and moves the schedule)."""
        self.update.hold_landed()
