"""Who runs Adam, when, and on which cores: the optimizer half of the engine's step, chosen from the config.

The states say where the model states live; `OptimizerStep` says how the optimizer step runs over them:
  - the cores each side runs on (module 5's `zero_offload.cores`): the device's compute on some, the host's
    queue (its Adam, its copies on the emulated device) on the others;
  - the updaters (implementation/updaters.py) that run Adam at the step: serial, module 5's overlapped
    pipeline, or the NVMe tier; then, with module 4's partial offload, the units kept on the device;
  - module 5's delayed update, which takes the step's Adam over from them once its warm-up is done;
  - whether the host's Adam sums the gradient norm in its own pass (`norm_in_adam`).

Its `step` is everything between "the gradients are reduced and checked for overflow" and "the step is
recorded": the clip factor, Adam, the new weights published, the learning-rate schedule.
"""

from __future__ import annotations

import math
import os

import torch

from ..basics.norm import global_norm
from ..config import Config
from ..implementation.updaters import SerialUpdater
from ..practice.dpu import DelayedUpdate, DelayedUpdater
from ..practice.nvme import NVMeUpdater
from ..practice.pipeline import HostQueue, OffloadPipeline
from ..tuning.cpu_adam import host_adam
from ..tuning.partial import DevicePartUpdater


def wants_norm_in_adam(config: Config, host_adam, *, whole_partition: bool) -> bool:
    """Whether the host's Adam sums the gradient norm in its own pass: the C Adam can, and then the norm need not
    be known before Adam runs: nothing to clip. Not with units left on the device (their Adam sums nothing), and
    not under DPU, whose norm is reported before its Adam runs; serial and pipelined steps alike, so that they
    report the same number."""
    sums = host_adam is not None and host_adam.sums_norm
    dpu = config.zero_offload.delayed_param_update.enabled
    return sums and whole_partition and config.gradient_clipping == 0 and not dpu


def keeps_gradients(config: Config, host_adam) -> bool:
    """Whether the delayed update reads each step's gradients where they landed, in areas of their own
    (practice/host_gradients.py): one micro-batch (nothing to add up), an Adam that reads them as they came
    down (fp32 ones: any; bf16: module 4's C Adam), and no fp16 (its loss scale and overflow check work on the
    fp32 partition)."""
    dpu = config.zero_offload.delayed_param_update.enabled
    reads = host_adam is not None and (host_adam.reads_low_precision_grads or config.precision == "fp32")
    return dpu and reads and config.gradient_accumulation_steps == 1 and not config.fp16.enabled


def pin_cores(config: Config) -> None:
    """Module 5: this thread (the emulated device's compute) on `cores.device`. The C Adam's threads were sized
    to `cores.host`, where the host queue runs it, when it was built (optimizers.py)."""
    cores = config.zero_offload.cores
    if cores.device:
        os.sched_setaffinity(0, cores.device)
        torch.set_num_threads(len(cores.device))


class OptimizerStep:
    """The updaters and module 5's pieces for `states`, over `optimizers` (optimizers.Optimizers).

    `scaler`, `skip_guard`, `timeline` and `lr_scheduler` are the engine's; they are read, never replaced."""

    def __init__(
        self, config: Config, states, accel, comm, *, optimizers, scaler, skip_guard, timeline, lr_scheduler
    ):
        self.config, self.states, self.comm, self.optimizers = config, states, comm, optimizers
        self.scaler, self.skip_guard, self.lr_scheduler = scaler, skip_guard, lr_scheduler
        # Module 3's Adam, or module 4's one-pass C Adam: the host's, of offloaded states; else the device's.
        self.host_adam = host_adam(optimizers.host) if optimizers.host is not None else None
        ext, split = config.zero_offload, optimizers.split
        whole = split == len(states.master_params)
        norm_in_adam = wants_norm_in_adam(config, self.host_adam, whole_partition=whole)
        pin_cores(config)
        self.pipeline = self.delayed = self.host_queue = None
        if ext.overlap_offload or ext.delayed_param_update.enabled or ext.cores.host:
            # The host's work runs on a queue of its own; with cores.host, on those cores only.
            self.host_queue = HostQueue("zo-host", list(ext.cores.host) or None)
        if ext.overlap_offload:
            self.pipeline = OffloadPipeline(
                states,
                accel,
                host=self.host_queue,
                host_adam=self.host_adam,
                timeline=timeline,
                needs_whole_gradient=config.fp16.enabled or config.gradient_clipping > 0,
                micro_batches=config.gradient_accumulation_steps,
                norm_in_adam=norm_in_adam,
                cores=list(ext.cores.host) or None,
                slots=ext.staging_slots,
                keep_gradients=keeps_gradients(config, self.host_adam),
            )
            # Wired here, where both are made: from now on the states hand the host units' gradients to it.
            states.hand_gradients_to(self.pipeline)
        if ext.delayed_param_update.enabled:
            # With the pipeline every write of the host's gradients is queued on the host behind Adam: no copy.
            update = DelayedUpdate(
                self.host_queue, ext.delayed_param_update.start_step, copy_gradients=self.pipeline is None
            )
            self.delayed = DelayedUpdater(
                update,
                states,
                self.host_adam,
                accel=accel,
                timeline=timeline,
                pipeline=self.pipeline,
                lr_scheduler=lr_scheduler,
            )
        self.updaters = self._updaters(config, timeline, norm_in_adam)
        # Every updater sums the norm in its Adam: the step takes no pass of its own over the gradients.
        self.norm_in_adam = all(u.norm_in_adam for u in self.updaters)

    def _updaters(self, config: Config, timeline, norm_in_adam: bool) -> list:
        """Each has update(grads, clip_factor, norms) -> Update (implementation/updaters.py) and norm_in_adam."""
        states, split, updaters = self.states, self.optimizers.split, []
        if self.pipeline is not None:  # module 5: overlapped with backward and the copies
            updaters.append(self.pipeline)
        elif config.zero_optimization.offload_optimizer.device == "nvme":  # module 5: from files
            updaters.append(NVMeUpdater(states, self.host_adam, timeline=timeline))
        elif self.host_adam is not None:
            updaters.append(
                SerialUpdater(
                    states,
                    self.host_adam,
                    split,
                    timeline=timeline,
                    queue=self.host_queue,
                    norm_in_adam=norm_in_adam,
                )
            )
        if split < len(states.master_params):  # module 4: the units kept on the device
            updaters.append(DevicePartUpdater(states, self.optimizers.device, split, timeline=timeline))
        return updaters

    def delayed_at(self, step: int) -> bool:
        """Whether module 5's delayed update runs step `step` (its warm-up steps run undelayed)."""
        return self.delayed is not None and self.delayed.active(step)

    def begin_backward(self, *, last: bool, step: int) -> None:
        """Module 5 decides how far this backward may run ahead of the step (`last`: it closes the window)."""
        if self.pipeline is not None:
            self.pipeline.begin_backward(last=last, delayed=self.delayed_at(step))

    def step(self, step: int, record: dict, skip: str | None) -> str | None:
        """Optimizer step `step` (0-based), unless `skip` says why not; returns why it was skipped, if it was.

        A skipped update is skipped whole: master weights, moments and the schedule are not touched."""
        if self.delayed_at(step):
            skip = self._delayed_step(step, record, skip)
        elif skip is None:
            skip = self._update(step, record)
            if skip is None and self.lr_scheduler is not None:
                self.lr_scheduler.step()
        if self.pipeline is not None:
            self.pipeline.new_step()
        return skip

    def _clip_factor(self, grads: list[torch.Tensor], record: dict) -> float | None:
        """The factor that clips the gradients to gradient_clipping; None if their norm is not finite (the
        same on every rank: the norm is reduced), and then the step must be skipped."""
        norm = self.states.grad_norm(grads)
        record["grad_norm"] = norm
        if not math.isfinite(norm):
            return None
        clip = self.config.gradient_clipping
        return clip / (norm + 1e-6) if clip > 0 and norm > clip else 1.0

    def _update(self, step: int, record: dict) -> str | None:
        """Adam over every partition and the new weights published; or, for a non-finite gradient norm seen
        before any Adam ran, nothing, and the reason to skip the step."""
        grads = self.states.fp32_gradients(1.0 / self.scaler.scale)
        norms = [] if self.norm_in_adam else None  # each unit's squared norm, summed by the C Adam on its way
        clip_factor = 1.0 if self.norm_in_adam else self._clip_factor(grads, record)
        if clip_factor is None:
            if self.pipeline is not None and self.pipeline.updated:  # eager: Adam ran during backward
                how = "the overlapped pipeline runs Adam on each unit during backward (no clipping, no fp16)"
                raise self.skip_guard.poisoned(step + 1, record["grad_norm"], how)
            return "non-finite gradient norm"
        updates = [updater.update(grads, clip_factor, norms) for updater in self.updaters]
        record["adam_seconds"] = updates[0].seconds if updates else 0.0  # the host's, when offloaded
        if norms is not None:
            record["grad_norm"] = global_norm(norms, self.comm.sum)
            if not math.isfinite(record["grad_norm"]):
                how = "without gradient_clipping the C Adam sums the norm in its own pass over the gradients"
                raise self.skip_guard.poisoned(step + 1, record["grad_norm"], how)
        # Module 4's one pass may have rounded into the staging buffers already: then publish only uploads.
        self.states.publish(rounded=any(update.rounded for update in updates))
        return None

    def _delayed_step(self, step: int, record: dict, skip: str | None) -> str | None:
        """Module 5's delayed update: publish step t-1's update, launch step t's on the host (practice/dpu.py).
        The norm is known before this step's Adam launches: a non-finite one skips it (the reason returned)."""
        grads = [] if skip else self.delayed.gradients(1.0 / self.scaler.scale)
        clip_factor = 1.0 if skip else self._clip_factor(grads, record)
        if clip_factor is None:
            skip, grads = "non-finite gradient norm", []
        self.delayed.step(grads, clip_factor, skip=skip is not None)
        return skip

    def synchronize(self) -> None:
        """Finish a delayed update still in flight and publish its weights."""
        if self.delayed is not None:
            self.delayed.synchronize()

    def land(self) -> bool:
        """Wait for a delayed update still in flight, without publishing it: the next step does, as if nothing
        had looked. True if one has landed and awaits its publish (a checkpoint saves that)."""
        return self.delayed is not None and self.delayed.land()

    def hold_landed(self, step: int) -> bool:
        """The masters hold an update that has landed but is not published (a checkpoint's): step `step`
        publishes it, if the delayed update runs that step. False if it does not: publish it now."""
        if not self.delayed_at(step):
            return False
        self.delayed.hold_landed()
        return True

    def close(self) -> None:
        """Stop the host queue and the pipeline's streams, after running what is queued on them."""
        streams = [self.host_queue]
        if self.pipeline is not None:
            streams += [self.pipeline.down, self.pipeline.up]
        for stream in streams:
            if stream is not None:
                stream.close()
