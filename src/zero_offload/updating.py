"""Who runs Adam, when, and on which cores: the engine's updaters, chosen from the config.

The states say where the model states live; this says how the optimizer step runs over them:
  - the cores each side runs on (module 5's `zero_offload.cores`): the device's compute on some, the host's
    queue (its Adam, its copies on the emulated device) on the others;
  - the updaters (implementation/updaters.py) that run Adam at the step: serial, module 5's overlapped
    pipeline, or the NVMe tier; then, with module 4's partial offload, the units kept on the device;
  - module 5's delayed update, which takes the step's Adam over from them once its warm-up is done;
  - whether the host's Adam sums the gradient norm in its own pass (`norm_in_adam`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .config import Config
from .implementation.updaters import SerialUpdater
from .practice.dpu import DelayedUpdate, DelayedUpdater
from .practice.nvme import NVMeUpdater
from .practice.pipeline import HostQueue, OffloadPipeline
from .tuning.cpu_adam import CPUAdam
from .tuning.partial import DevicePartUpdater


@dataclass
class Updating:
    updaters: list  # each has update(grads, clip_factor, norms) -> seconds and norm_in_adam
    norm_in_adam: bool  # every updater sums the norm in its Adam: the engine takes no pass of its own
    pipeline: OffloadPipeline | None = None
    delayed: DelayedUpdater | None = None
    host_queue: HostQueue | None = None


def wants_norm_in_adam(config: Config, host_adam, *, whole_partition: bool) -> bool:
    """Whether the host's Adam sums the gradient norm in its own pass: the C Adam can, and then the norm need not
    be known before Adam runs: nothing to clip. Not with units left on the device (their Adam sums nothing), and
    not under DPU, whose norm is reported before its Adam runs; serial and pipelined steps alike, so that they
    report the same number."""
    sums = host_adam is not None and host_adam.sums_norm
    dpu = config.zero_offload.delayed_param_update.enabled
    return sums and whole_partition and config.gradient_clipping == 0 and not dpu


def pin_cores(config: Config, host_optimizer) -> None:
    """Module 5: this thread (the emulated device's compute) on `cores.device`; the C Adam's threads sized to
    `cores.host`, where the host queue runs it."""
    cores, threads = config.zero_offload.cores, config.zero_offload.cpu_adam.threads
    if cores.device:
        os.sched_setaffinity(0, cores.device)
        torch.set_num_threads(len(cores.device))
    if cores.host and isinstance(host_optimizer, CPUAdam) and threads is None:
        host_optimizer.threads = len(cores.host)


def build_updating(
    config: Config, states, accel, *, optimizers, host_adam, timeline, lr_scheduler
) -> Updating:
    """The updaters and module 5's pieces for `states`, with `optimizers` (optimizers.Optimizers) and the host's
    Adam built over them; `timeline` and `lr_scheduler` are the engine's."""
    ext, split = config.zero_offload, optimizers.split
    norm_in_adam = wants_norm_in_adam(config, host_adam, whole_partition=split == len(states.master_params))
    pin_cores(config, optimizers.host)
    pipeline = delayed = host = None
    if ext.overlap_offload or ext.delayed_param_update.enabled or ext.cores.host:
        # The host's work runs on a queue of its own; with cores.host, on those cores only.
        host = HostQueue("zo-host", list(ext.cores.host) or None)
    if ext.overlap_offload:
        pipeline = OffloadPipeline(
            states,
            accel,
            host=host,
            host_adam=host_adam,
            needs_whole_gradient=config.fp16.enabled or config.gradient_clipping > 0,
            micro_batches=config.gradient_accumulation_steps,
            norm_in_adam=norm_in_adam,
            cores=list(ext.cores.host) or None,
            slots=ext.staging_slots,
        )
    if ext.delayed_param_update.enabled:
        # With the pipeline every write of the host's gradients is queued on `host` behind Adam: no copy.
        update = DelayedUpdate(host, ext.delayed_param_update.start_step, copy_gradients=pipeline is None)
        delayed = DelayedUpdater(
            update,
            states,
            host_adam,
            accel=accel,
            timeline=timeline,
            pipeline=pipeline,
            lr_scheduler=lr_scheduler,
        )
    updaters = []
    if pipeline is not None:  # module 5: overlapped with backward and the copies
        updaters.append(pipeline)
    elif config.zero_optimization.offload_optimizer.device == "nvme":  # module 5: from files
        updaters.append(NVMeUpdater(states, host_adam, timeline=timeline))
    elif host_adam is not None:
        serial = SerialUpdater(
            states, host_adam, split, timeline=timeline, queue=host, norm_in_adam=norm_in_adam
        )
        updaters.append(serial)
    if split < len(states.master_params):  # module 4: the units kept on the device
        updaters.append(DevicePartUpdater(states, optimizers.device, split, timeline=timeline))
    return Updating(updaters, all(u.norm_in_adam for u in updaters), pipeline, delayed, host)
