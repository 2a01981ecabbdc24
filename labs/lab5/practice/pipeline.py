"""The overlapped offload step: copies and the CPU's Adam hide behind the device's work (module 5).

Module 3's step is serial: backward, then every gradient shard down (D2H), then Adam over the whole
partition, then every weight shard up (H2D). While the CPU runs Adam the device idles, and while the device
runs backward the CPU idles. Here each unit's shard moves through three queues as soon as it exists:

    down stream   D2H(k)   D2H(k+1)                                   (the link, down: a DMA engine on a GPU)
    host queue             accumulate(k) -> Adam(k)                   (the CPU, on its own cores)
    up stream                                        H2D(k)           (the link, up: a second DMA engine)
    device        backward keeps going; the all-gathers wait for the step

so bucket k's Adam runs while bucket k+1 is copied down and bucket k-1's weights go up. Gradients reach the
host during backward whenever this module is on. Adam itself can only start before backward has ended when
nothing needs the whole gradient first: no fp16 overflow check, no clipping to the global norm, the last
micro-batch of the accumulation, no delayed update. Otherwise it runs at the step, still overlapped with the
uploads.

Host staging is double-buffered: two slots for gradients on their way down and two for weights on their way
up, used in turn. A slot may be written again only when the work that reads it has finished (`SlotRing`), so
bucket k+2 never overwrites what bucket k's accumulate or upload has not read yet.

On the emulated device a "stream" is a worker thread and an event a future; torch's kernels and the C Adam
release the GIL, so this is real overlap on two cores. Each direction has its own stream, as a GPU has a copy
engine for each: an upload waits for its unit's Adam, and on a single in-order stream that wait would hold up
the next gradient's way down, so that D2H, Adam and H2D ran one after the other. On CUDA the two streams are
CUDA streams and the copies are asynchronous DMA from pinned memory; a CUDA stream cannot wait for a host thread
without blocking the thread that asks, so there Adam runs at the step (each unit's upload still overlapping the
next unit's Adam) rather than during backward.

`OffloadPipeline` owns the streams, the slots and the schedule, and three parts, each built in its constructor
and handed what it needs with each call: the fp32 gradient partition and its state, DPU's kept gradients
(host_gradients.py), and the delayed update's uploads during the next backward (early_uploads.py).
"""

from __future__ import annotations

import warnings

import torch

from ..accelerator import Accelerator
from ..accelerator.streams import Event, WorkerStream
from ..basics.norm import squared_norm
from ..implementation.offload import HostAdam
from ..implementation.transfers import host_buffer
from ..implementation.updaters import Update
from .early_uploads import EarlyUploads
from .host_gradients import GradientPartition, KeptGradients, PartitionState


class HostQueue(WorkerStream):
    """The CPU's share of the step: one thread that runs its queue in order, optionally on `cores` only.

    Pinning models a GPU and a CPU as separate processors on a machine that has only CPUs: the device's
    compute keeps its cores, the host's Adam gets the others, and neither waits for the other's cores. On those
    cores the emulated device's copies run too, as memcpy by the copy streams' threads, standing in for DMA
    engines that take no time from the CPU. So a pinned host queue yields to them: at the same priority, a copy
    that wakes while Adam runs waits milliseconds for the core, and backward waits for the copy."""

    def __init__(self, name: str, cores: list[int] | None = None):
        super().__init__(name, cores, nice=10 if cores else 0)


class SlotRing:
    """`count` host buffers used in turn; the k-th use gets slot k % count.

    Each slot remembers the event of the last work that reads it. Whoever writes a slot must first make its
    stream wait for that event: otherwise bucket k + count overwrites bucket k before it has been read.
    """

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = buffers
        self._readers: list[Event | None] = [None] * len(buffers)
        self.uses = 0

    def acquire(self, writer, numel: int) -> tuple[int, torch.Tensor]:
        """The next slot, as a view of `numel` elements, with `writer` (a stream) made to wait until it is free."""
        slot = self.uses % len(self.buffers)
        self.uses += 1
        # Lab 5.2: a slot is written only after its last reader has finished
        # self._readers[slot] is the event of the work that last read this slot (None before its first use).
        # Make `writer` wait for it (writer.wait_event(...)), so that whatever `writer` runs next cannot
        # overwrite data that has not been read yet. Then return the slot number and the first `numel`
        # elements of self.buffers[slot].
        raise NotImplementedError("Lab 5.2: a slot is written only after its last reader has finished")

    def release(self, slot: int, reader: Event) -> None:
        """`reader` is the event of the last work that reads `slot` this time round."""
        self._readers[slot] = reader


def warn_pageable_copies(states, accel: Accelerator, keep_gradients: bool) -> None:
    """On a GPU, a copy from or into pageable memory blocks the thread that asks for it: the buffers the pipeline
    copies straight from or into (not its pinned slots) then take its overlap away, without a word otherwise."""
    if states.pin_optimizer or accel.device.type != "cuda":
        return
    which = []
    if states.dtype == torch.float32:
        which.append("the fp32 master weights, uploaded straight from the host")
    if keep_gradients:
        which.append("the delayed update's gradient areas")
    if which:
        warnings.warn(
            f"overlap_offload copies {' and '.join(which)} while offload_optimizer.pin_memory is false: from "
            'pageable memory those copies block and do not overlap; set "pin_memory": true in offload_optimizer',
            stacklevel=4,
        )


class OffloadPipeline:
    """Runs the offloaded part of a step (OffloadedStates' host units) through the down stream (D2H), the host
    queue and the up stream (H2D). One gradient: `receive` copies it down and queues the host's work on it
    (`_queue_on_host`), which adds it up, or runs the unit's Adam and queues its upload (`_adam_then_upload`)."""

    def __init__(
        self,
        states,
        accel: Accelerator,
        *,
        host: HostQueue,
        host_adam: HostAdam,
        timeline,
        needs_whole_gradient: bool,
        micro_batches: int,
        norm_in_adam: bool,
        cores=None,
        slots: int = 2,
        keep_gradients: bool = False,
    ):
        """`timeline`: where Adam's spans go; `needs_whole_gradient`: Adam must wait for backward's end (fp16's
        overflow check, clipping to the global norm); `micro_batches`: gradient accumulation steps;
        `norm_in_adam`: the host's Adam sums each unit's squared norm in its own pass (nothing to clip, so
        nothing needs the norm before Adam); `keep_gradients`: the delayed update reads each step's gradients
        where they landed (host_gradients.py)."""
        self.states, self.transfers, self.host_adam = states, states.transfers, host_adam
        self.timeline = timeline
        self.needs_whole_gradient, self.micro_batches = needs_whole_gradient, micro_batches
        # On the emulated device the copies are memcpy by a CPU core: the host's (`cores`), standing in for
        # the DMA engines, so that they do not take the device's compute core. One stream for each direction.
        self.down = accel.new_stream("zo-d2h", cores)
        self.up = accel.new_stream("zo-h2d", cores)
        self.host = host
        units = states.units[: states.host_units]
        largest = max((u.shard_numel for u in units), default=0)
        warn_pageable_copies(states, accel, keep_gradients)

        # Always pinned: a few units' worth, and from pageable memory no copy overlaps anything.
        def ring(dtype):
            return SlotRing([host_buffer(accel, largest, dtype, pin=True) for _ in range(slots)])

        self.grad_slots = ring(states.dtype)
        # fp32 weights upload straight from the master; with offload_param they never leave the host.
        self.weight_slots = None
        if states.dtype != torch.float32 and not states.offload_param:
            self.weight_slots = ring(states.dtype)

        # The parts: where the host's gradients go, and DPU's uploads during the next backward.
        self.partition = GradientPartition(states.flat_grad, states.grad_shards, host)
        # DPU with one micro-batch: each step's gradients in an area of their own.
        self.kept = None
        if keep_gradients:
            sizes = [unit.shard_numel for unit in units]
            pin, to_host = states.pin_optimizer, self.transfers.to_host
            self.kept = KeptGradients(accel, sizes, states.dtype, pin=pin, to_host=to_host)
        self.early = EarlyUploads(states.param_staging, states.param_shards, self.transfers.to_device)

        # Decided at each backward (begin_backward): `eager`, Adam runs as each gradient arrives; `final`,
        # this backward is the last micro-batch before the step.
        self.eager = False
        self.final = False
        # Eager with a single micro-batch and the C Adam: the gradient is never added anywhere, so Adam reads
        # the staging slot itself, and the fp32 gradient partition is neither written nor cleared.
        self.direct = False
        # This step's gradients go to the kept areas.
        self.keeping = False

        # Unit -> squared norm of its complete gradient.
        self.squared_norms: dict[int, float] = {}
        self.norm_in_adam = norm_in_adam
        self.clip_factor = 1.0
        # What must finish before the step can go on.
        self._pending: list[Event] = []
        # Device shards whose copy may still read them.
        self._alive: list[tuple[torch.Tensor, Event]] = []
        # Units whose Adam has been queued this step.
        self.updated: set[int] = set()
        self.adam_seconds = 0.0

    def begin_backward(self, *, last: bool, delayed: bool) -> None:
        """Decide how far this backward may run ahead of the step. `last`: the last micro-batch before the step;
        `delayed`: the delayed update is on for this step (its Adam runs at the step, on a snapshot)."""
        self.final = last
        # Adam may start before backward has ended only if nothing needs the whole gradient first, and if the
        # up stream can wait for the host's Adam without blocking backward's thread (not a CUDA stream).
        self.eager = last and not self.needs_whole_gradient and not delayed and self.up.waits_without_blocking
        self.direct = self.host_adam.reads_low_precision_grads and self.micro_batches == 1
        self.keeping = self.kept is not None and delayed

    # -- backward: called by OffloadedStates as each reduced shard is ready -----------------------------------
    def receive(self, index: int, shard: torch.Tensor) -> None:
        """Backward hands over unit `index`'s reduced shard: down the link, then into the fp32 partition and
        (eager) Adam, or, under DPU, into this step's kept area."""
        if self.early.update is not None and self.final:
            # DPU: backward is done with this unit, so the delayed update's new weights may go up now.
            self.early.upload(index, self.up)
        if self.keeping:
            # DPU: this step's gradient stays where it lands until the delayed Adam.
            norms = self.squared_norms
            copied, done = self.kept.receive(index, shard, down=self.down, host=self.host, norms=norms)
            self._pending.append(done)
            self._hold_until_copied(shard, copied)
            return
        # Lab 5.1: the double-buffered bucket schedule
        # The delayed update's two cases above are given; here is every other gradient's way to the host.
        # 1. slot, staging = self.grad_slots.acquire(self.down, shard.numel()): a free staging slot, with the
        #    down stream made to wait until it is free (Lab 5.2).
        # 2. copied = self.down.submit(self.transfers.to_host, staging, shard, blocking=False): the D2H copy,
        #    on the down stream, so that backward goes on while it runs.
        # 3. The host must not read the slot before the copy has landed: self.host.wait_event(copied). Then
        #    done = self._queue_on_host(index, staging) queues the host's work on it (add it into the fp32
        #    gradient partition; or, eager, run the unit's Adam and queue its upload) and returns the event of
        #    that work's last read of the slot.
        # 4. That work is the slot's last reader: self.grad_slots.release(slot, done). Keep the device shard
        #    alive until the copy has read it: self._hold_until_copied(shard, copied).
        raise NotImplementedError("Lab 5.1: the double-buffered bucket schedule")

    def _hold_until_copied(self, shard: torch.Tensor, copied: Event) -> None:
        """Hold the device shard until `copied` (a CUDA allocator would otherwise reuse memory a copy is still
        reading), and keep no more shards waiting than there are staging slots: when the host falls behind,
        backward waits here, as it would for device memory, rather than pile up gradients on the device."""
        self._alive = [(t, e) for t, e in self._alive if not e.done()] + [(shard, copied)]
        while len(self._alive) > len(self.grad_slots.buffers):
            self._alive.pop(0)[1].wait()

    def _queue_on_host(self, index: int, staging: torch.Tensor) -> Event:
        """Queue the host's work on a gradient that has arrived in `staging`; the event of its last read."""
        if self.eager and self.direct:
            # Nothing to add it to: Adam reads the slot itself.
            return self._adam_then_upload(index, grad=staging)
        self._clear_partition_if(PartitionState.UNDEFINED)
        # The gradient is complete after this add: its share of the global norm, here rather than at the step
        # (unless the C Adam sums it on its way through).
        norms = self.squared_norms if self.final and not self.norm_in_adam else None
        done = self.partition.add(index, staging, 1.0 / self.states.loss_scale(), norms)
        self._pending.append(done)
        if self.eager:
            self._adam_then_upload(index)
        return done

    def _clear_partition_if(self, state: PartitionState) -> None:
        cleared = self.partition.clear_if(state)
        if cleared is not None:
            self._pending.append(cleared)

    def define_gradients(self) -> None:
        """Before the step reads the fp32 partition: a unit no gradient reached this step reads zeros there, not
        memory that a direct run (which never writes the partition) left as it was allocated."""
        if self.partition.state is PartitionState.UNDEFINED and len(self.updated) < self.states.host_units:
            self._clear_partition_if(PartitionState.UNDEFINED)
            self.wait()

    def zero_grad(self) -> None:
        """Clear the host's fp32 gradients on the host queue, behind this step's work, while forward runs."""
        self._clear_partition_if(PartitionState.DIRTY)

    # -- the step ------------------------------------------------------------------------------------------
    def update(self, grads: list[torch.Tensor], clip_factor: float, norms: list | None = None) -> Update:
        """The step's part (the updater's call, see implementation/updaters.py): Adam over every host unit
        not yet updated during backward, each unit's upload overlapping the next unit's Adam; then wait. The
        gradients are the fp32 partition this pipeline filled. `norms` gets each unit's squared norm as its
        Adam summed it. Returns the seconds Adam ran on the host; the units it rounds, it also uploads
        (published_units), so publish() is told nothing was rounded for it."""
        self.clip_factor = clip_factor
        missed = [i for i in range(self.states.host_units) if i not in self.updated]
        if missed:
            # A unit no gradient reached (unused this step) reads zeros, as in the serial step.
            self._clear_partition_if(PartitionState.UNDEFINED)
        for index in missed:
            self._adam_then_upload(index)
        self.wait()
        if norms is not None:
            norms += [self.squared_norms[i] for i in range(self.states.host_units)]
        return Update(self.adam_seconds)

    def _adam_then_upload(self, index: int, grad: torch.Tensor | None = None) -> Event:
        """Queue Adam on unit `index` behind what the host queue already holds, then its weights' upload on the
        up stream; the event of Adam. `grad`: a staging slot Adam reads directly (module 4's C Adam only)."""
        states = self.states
        self.updated.add(index)
        slot, out = None, None
        if states.offload_param:
            # The weights live on the host: rounded in place, gathered later.
            out = states.param_shards[index]
        elif self.weight_slots is not None:
            # fp16/bf16: rounded into an upload slot in the same pass.
            slot, out = self.weight_slots.acquire(self.host, states.units[index].shard_numel)
        adam = self.host.submit(self._adam, index, out, grad)
        self._pending.append(adam)
        if not states.offload_param:
            # On CUDA this blocks until Adam is done: see the engine's `eager`.
            self.up.wait_event(adam)
            # fp32 weights go up from the master itself.
            source = out if out is not None else states.master_params[index]
            target = states.param_shards[index]
            uploaded = self.up.submit(self.transfers.to_device, target, source, blocking=False)
            if slot is not None:
                # Before the slot's next acquire, which must wait for it.
                self.weight_slots.release(slot, uploaded)
            self._pending.append(uploaded)
        return adam

    def _adam(self, index: int, out: torch.Tensor | None, staged: torch.Tensor | None = None) -> None:
        master, grad = self.states.master_params[index], self.partition.shards[index]
        with self.timeline.adam() as clock:
            if staged is not None:
                # Straight from the slot: the gradient is this micro-batch's, loss scale 1.
                grad = staged
                if not self.norm_in_adam:
                    self.squared_norms[index] = squared_norm(grad)
            squares = self.host_adam.update(master, grad, out, self.clip_factor, norm=self.norm_in_adam)
            if squares is not None:
                self.squared_norms[index] = squares
        self.adam_seconds += clock.seconds

    def staging_buffers(self) -> list[torch.Tensor]:
        """The host buffers this pipeline holds beyond the model states: its gradient and weight slots, and
        the delayed update's two areas; what the memory report counts as host staging."""
        buffers = list(self.grad_slots.buffers)
        buffers += self.weight_slots.buffers if self.weight_slots is not None else []
        buffers += self.kept.buffers() if self.kept is not None else []
        return buffers

    # -- the delayed update (dpu.py): its gradients and its uploads during the next backward -----------------
    def kept_gradients(self) -> list[torch.Tensor]:
        """The gradients this step's backward kept, for the delayed Adam to read (host_gradients.py)."""
        return self.kept.gradients()

    def upload_during_backward(self, update: Event) -> None:
        """`update`, the delayed Adam just launched, rewrites every host unit's weights: each may go up as soon
        as the next backward is done with it (early_uploads.py)."""
        self.early.start(update)

    def take_early_uploads(self) -> set[int]:
        """Wait for the uploads queued during backward and forget them; the units they covered."""
        return self.early.take()

    def published_units(self) -> set[int]:
        """The units whose new weights this step already went where forward reads them (rounded, and uploaded
        unless they live on the host): publish() leaves them alone."""
        return self.take_early_uploads() | self.updated

    def wait(self) -> None:
        """Block until everything scheduled has finished; an error raised on a queue surfaces here."""
        pending, self._pending = self._pending, []
        try:
            for event in pending:
                event.wait()
        finally:
            self._alive = []

    def new_step(self) -> None:
        """Forget the last step's bookkeeping (call after wait())."""
        self.updated = set()
        self.squared_norms = {}
        self.adam_seconds = 0.0
        if self.kept is not None:
            self.kept.next_area(kept=self.keeping)
