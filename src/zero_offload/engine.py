"""The engine: composes the pieces of the five modules into `forward`, `backward`, `step`.

It keeps the training loop's logic (loss scaling, accumulation, skipping steps with an inf or nan in any
precision and stopping a run that keeps skipping (divergence.py), clipping, the Adam step, the learning-rate
schedule) and hands the model states to one object that decides where they live: module 1's
`MixedPrecisionStates` (stage 0), module 2's `ShardedStates` (stages 1-3, all on the device) or module 3's
`OffloadedStates` (the fp32 optimizer half on the host) or module 5's `NVMeStates` (that half in files, a few
sub-groups in host memory at a time). Overlap arrives with module 5, as another piece.
"""

from __future__ import annotations

import atexit
import math
import warnings
import weakref

import torch

from .accelerator import Accelerator, HintOnOutOfMemory, get_accelerator
from .basics.memory import MemoryLedger, MemoryReport
from .basics.precision import (
    DynamicLossScaler,
    MixedPrecisionStates,
    StaticLossScaler,
    unique_parameters,
)
from .config import Config, check_supported, load_config
from .divergence import SkipGuard
from .implementation.offload import OffloadedStates
from .implementation.schedulers import build_scheduler
from .model_setup import check_same_parameters, install_upcast_hooks, place_buffers_and_frozen, to_device
from .optimizers import build_optimizers
from .practice.nvme import NVMeStates
from .practice.timeline import Span, Timeline, gather_timeline
from .principles.comm import Comm
from .principles.process_group import join_launcher_group
from .principles.recompute import checkpoint_blocks
from .principles.zero import ShardedStates
from .tuning.cpu_adam import host_adam
from .tuning.partial import PartialOffloadStates, estimate_for_config
from .updating import build_updating

# Engines not closed yet. At exit they are closed, so that a script which never calls engine.close() still ends
# cleanly (no thread of the engine's running, the group it joined destroyed) while the interpreter is whole.
_open_engines: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    for engine in list(_open_engines):
        engine.close()


class Engine:
    """Trains `model` as the config says. Use it as `loss_fn(engine(x), y)`, `engine.backward(loss)`, `engine.step()`."""

    def __init__(self, model: torch.nn.Module, config: Config, *, accelerator: Accelerator | None = None):
        check_supported(config)
        self._closed = False
        self._owns_process_group = (
            False  # zo.initialize joined the group for this engine: close() destroys it
        )
        self.config = config
        self.accelerator = accelerator or get_accelerator(config.zero_offload.device_memory)
        self.model = model
        self.comm = Comm()
        if self.comm.world_size != config.world_size:
            raise ValueError(
                f"the config was loaded for {config.world_size} rank(s) but {self.comm.world_size} are running; "
                "pass the config through zo.initialize so that it reads the world size itself"
            )
        self.comm.check_same("configs", config.fingerprint())
        check_same_parameters(self.comm, model)  # before the states' collectives, which would mispair
        params = unique_parameters(model)
        if not params:
            raise ValueError("the model has no trainable parameters")
        if config.fp16.enabled:
            self.scaler = DynamicLossScaler.from_config(config.fp16)
        else:
            self.scaler = StaticLossScaler(1.0)  # bf16 and fp32 have fp32's exponent range: no scaling
        zero = config.zero_optimization
        self._offloaded = zero.stage > 0 and zero.offload_optimizer.enabled
        if zero.stage == 0:
            self.states = MixedPrecisionStates(params, self.accelerator, config.precision, self.comm)
        elif zero.offload_optimizer.enabled:
            tier = OffloadedStates
            if zero.offload_optimizer.device == "nvme":  # module 5
                tier = NVMeStates
            elif zero.offload_optimizer.ratio < 1.0:  # module 4
                tier = PartialOffloadStates
            self.states = tier(
                model,
                self.accelerator,
                config.precision,
                zero.stage,
                self.comm,
                zero,
                loss_scale=lambda: self.scaler.scale,
                pipelined=config.zero_offload.overlap_offload,
            )
        else:
            self.states = ShardedStates(
                model, self.accelerator, config.precision, zero.stage, self.comm, zero
            )
        self.params = self.states.params
        self.num_params = self.states.numel
        place_buffers_and_frozen(model, self.accelerator, self.states.dtype)
        optimizers = build_optimizers(config, self.states, offloaded=self._offloaded)
        self.optimizer, self._host_optimizer = optimizers.optimizer, optimizers.host
        self.lr_scheduler = build_scheduler(config.scheduler, self.optimizer)
        # Module 3's Adam, or module 4's one-pass C Adam (only ever the host's, of offloaded states).
        self._host_adam = host_adam(self._host_optimizer) if self._host_optimizer is not None else None
        self.ledger = MemoryLedger(self.accelerator)
        self.states.record(self.ledger)
        if self.accelerator.compute_dtype(self.states.dtype) != self.states.dtype:
            install_upcast_hooks(model, self.accelerator)
        if config.activation_checkpointing.enabled:
            checkpoint_blocks(model, self.accelerator, self.states.dtype)
        # Module 5: when each stage ran (practice/timeline.py); the collectives and copies record themselves.
        self._timeline = Timeline(accelerator=self.accelerator)
        self.comm.timeline = self._timeline
        if self._offloaded:
            self.states.transfers.timeline = self._timeline
        # Who runs Adam, when and on which cores (updating.py): the updaters, module 5's pipeline and delayed update.
        updating = build_updating(config, self.states, self.accelerator, optimizers=optimizers,
                                  host_adam=self._host_adam, timeline=self._timeline,
                                  lr_scheduler=self.lr_scheduler)  # fmt: skip
        self._updaters, self._norm_in_adam = updating.updaters, updating.norm_in_adam
        self._pipeline, self._delayed, self._host_queue = (
            updating.pipeline,
            updating.delayed,
            updating.host_queue,
        )
        self.micro_steps = 0  # backward calls so far
        self.global_steps = 0  # optimizer steps taken or skipped
        self.skipped_steps = 0
        # Counts the skips in a row nothing cures and stops the run at zero_offload.max_skipped_steps.
        self.skip_guard = SkipGuard(config.zero_offload.max_skipped_steps, fp16=config.fp16.enabled)
        self._window_skip: str | None = None  # why this accumulation window's step will be skipped
        self._boundary_at: int | None = None  # global_steps when backward last closed a window: step() is due
        self._warned_unstepped = False
        # One entry per optimizer step: loss scale, overflow, gradient norm, learning rate, Adam's seconds.
        self.history: list[dict] = []
        _open_engines.add(self)

    # -- forward ---------------------------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self._closed:
            raise RuntimeError("this engine was closed (engine.close()); make a new one with zo.initialize")
        args, kwargs = (to_device(v, self.accelerator, self.states.dtype) for v in (args, kwargs))
        self.states.before_forward()
        with self.accelerator.activations(self.states.dtype), self._timeline.span("forward"):
            return self.model(*args, **kwargs)

    forward = __call__

    # -- backward and step -----------------------------------------------------------------------------------------
    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.micro_steps % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Scale the loss (loss scale / accumulation steps) and accumulate gradients where the states keep them."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"backward needs the loss tensor returned by the forward, got {type(loss).__name__}; pass "
                "the loss itself (e.g. loss_fn(engine(x), y)), not loss.item() or a number"
            )
        if self._boundary_at == self.global_steps and not self._warned_unstepped:
            self._warned_unstepped = True
            warnings.warn(
                f"backward() was called again after {self.gradient_accumulation_steps} backward() call(s) "
                "with no engine.step() between: the gradients add up over more micro-batches than "
                "gradient_accumulation_steps says, so the next step is larger than intended; call engine.step() "
                "after every backward(), or raise gradient_accumulation_steps",
                UserWarning,
                stacklevel=2,
            )
        if loss.dim() != 0:
            raise ValueError(
                f"backward needs a scalar loss, got shape {tuple(loss.shape)}; reduce it first (mean)"
            )
        if self._pipeline is not None:  # module 5 decides how far this backward may run ahead of the step
            last = (self.micro_steps + 1) % self.gradient_accumulation_steps == 0
            delayed = self._delayed is not None and self._delayed.active(self.global_steps)
            self._pipeline.begin_backward(last=last, delayed=delayed)
        skip = self._nonfinite_loss(loss)
        self.states.before_backward()  # and after_backward: stage 3 releases what forward gathered
        if not skip:
            # Autograd's own buffers (activation gradients, recomputed layers) run out here, with torch's bare text.
            with self._timeline.span("backward"), HintOnOutOfMemory("activations"):
                (loss.float() * (self.scaler.scale / self.gradient_accumulation_steps)).backward()
        self.states.after_backward()
        self.micro_steps += 1
        self._boundary_at = self.global_steps if self.is_gradient_accumulation_boundary() else None

    def _nonfinite_loss(self, loss: torch.Tensor) -> bool:
        """bf16/fp32: whether this window's step is to be skipped for a non-finite loss on any rank. Its backward
        is skipped on every rank then (the collectives inside backward pair up), and so are the rest of the
        window's, so that no gradient, and no Adam the pipeline runs during backward, ever sees the inf or nan.

        fp16 is left to its overflow check after backward: there an inf loss is the scale's doing, and the
        skip is what lowers the scale. The check is one scalar (and a one-element collective) per micro-batch."""
        if self.config.fp16.enabled:
            return False
        if self._window_skip is None and self.comm.any(not bool(torch.isfinite(loss.detach()))):
            self._window_skip = "non-finite loss"
        return self._window_skip is not None

    def step(self) -> None:
        """At an accumulation boundary: reduce, check overflow, unscale, clip, update, publish; else nothing."""
        if self.micro_steps == 0 or not self.is_gradient_accumulation_boundary():
            return
        states, scaler = self.states, self.scaler
        states.reduce_gradients()
        skip, self._window_skip = self._window_skip, None
        if self.config.fp16.enabled and states.overflow():  # true on every rank if true on any
            skip = "fp16 overflow"
        record = {
            "step": self.global_steps,
            "loss_scale": scaler.scale,
            "overflow": skip is not None,
            "skipped": skip,  # why the step was skipped: fp16 overflow, non-finite loss or gradient norm
            "grad_norm": None,
            "lr": self.optimizer.param_groups[0]["lr"],
            "adam_seconds": 0.0,
        }
        # A skipped update is skipped whole: master weights, moments and the schedule are not touched.
        if self._delayed is not None and self._delayed.active(self.global_steps):
            skip = self._delayed_step(record, skip)
        elif skip is None:
            skip = self._update(record)
            if skip is None and self.lr_scheduler is not None:
                self.lr_scheduler.step()
        if skip is not None:
            record.update(overflow=True, skipped=skip)
            self.skipped_steps += 1
        if self._pipeline is not None:
            self._pipeline.new_step()
        diverged = self.skip_guard.after_step(self.global_steps + 1, skip, scaler)  # before the scale moves
        scaler.update(skip is not None)
        states.zero_grad()
        self.accelerator.fence_copies()  # the user's next write to a parameter lands after this step's uploads
        self.global_steps += 1
        self._timeline.step = self.global_steps
        self.history.append(record)
        if diverged is not None:
            raise diverged

    def _clip_factor(self, grads: list[torch.Tensor], record: dict) -> float | None:
        """The factor that clips the gradients to gradient_clipping; None if their norm is not finite (the
        same on every rank: the norm is reduced), and then the step must be skipped."""
        norm = self.states.grad_norm(grads)
        record["grad_norm"] = norm
        if not math.isfinite(norm):
            return None
        clip = self.config.gradient_clipping
        return clip / (norm + 1e-6) if clip > 0 and norm > clip else 1.0

    def _update(self, record: dict) -> str | None:
        """Adam over every partition and the new weights published; or, for a non-finite gradient norm seen
        before any Adam ran, nothing, and the reason to skip the step."""
        grads = self.states.fp32_gradients(1.0 / self.scaler.scale)
        norms = (
            [] if self._norm_in_adam else None
        )  # each unit's squared norm, summed by the C Adam on its way
        clip_factor = 1.0 if self._norm_in_adam else self._clip_factor(grads, record)
        if clip_factor is None:
            if self._pipeline is not None and self._pipeline.updated:  # eager: Adam ran during backward
                how = "the overlapped pipeline runs Adam on each unit during backward (no clipping, no fp16)"
                raise self.skip_guard.poisoned(self.global_steps + 1, record["grad_norm"], how)
            return "non-finite gradient norm"
        seconds = [updater.update(grads, clip_factor, norms) for updater in self._updaters]
        record["adam_seconds"] = seconds[0] if seconds else 0.0  # the host's, when offloaded
        if norms is not None:
            record["grad_norm"] = math.sqrt(self.comm.sum(sum(norms)))
            if not math.isfinite(record["grad_norm"]):
                how = "without gradient_clipping the C Adam sums the norm in its own pass over the gradients"
                raise self.skip_guard.poisoned(self.global_steps + 1, record["grad_norm"], how)
        self.states.publish()
        return None

    def _delayed_step(self, record: dict, skip: str | None) -> str | None:
        """Module 5's delayed update: publish step t-1's update, launch step t's on the host (practice/dpu.py).
        The norm is known before this step's Adam launches: a non-finite one skips it (the reason returned)."""
        grads = [] if skip else self.states.fp32_gradients(1.0 / self.scaler.scale)
        clip_factor = 1.0 if skip else self._clip_factor(grads, record)
        if clip_factor is None:
            skip, grads = "non-finite gradient norm", []
        self._delayed.step(grads, clip_factor, skip=skip is not None)
        return skip

    def synchronize(self) -> None:
        """Finish a delayed update still in flight and publish its weights (checkpoints call this)."""
        if self._delayed is not None:
            self._delayed.synchronize()

    def zero_grad(self) -> None:
        self.states.zero_grad()

    def close(self) -> None:
        """Finish the work in flight, stop the engine's threads and, if zo.initialize joined the process group
        for this script, destroy it (a group the script made is left alone). Idempotent; at exit, an engine
        still open is closed this way.

        No collective starts here, so a rank can close while another has failed. An update the delayed update
        still has in flight is finished but not published: call synchronize() first to see it in the model."""
        if self._closed:
            return
        self._closed = True
        _open_engines.discard(self)
        try:
            if self.config.zero_optimization.stage == 3:
                for index in range(len(self.states.units)):
                    self.states.release(index)  # waits for a prefetch still in flight
        finally:
            streams = [self._host_queue]
            if self._pipeline is not None:
                streams += [self._pipeline.copy, self._pipeline.upload]
            for stream in streams:
                if stream is not None:
                    stream.close()  # after running what is queued
            self.states.close()
            if self._owns_process_group and torch.distributed.is_initialized():
                heir = next(iter(_open_engines), None)  # another engine still trains on the same group
                if heir is not None:
                    heir._owns_process_group = True
                else:
                    torch.distributed.destroy_process_group()

    # -- checkpoints (implementation/checkpoint.py) ------------------------------------------------------------------
    def save_checkpoint(self, path) -> None:
        """Every rank writes its shard of the model states, with what it takes to resume, into directory `path`."""
        from .implementation.checkpoint import save_checkpoint

        self.synchronize()  # under a delayed update a checkpoint is a synchronisation point
        save_checkpoint(self, path)
        self.skip_guard.last_checkpoint = (str(path), self.global_steps)  # what a diverged run goes back to

    def load_checkpoint(self, path) -> None:
        """Resume from `path`, saved by any world size: shards are re-cut for this one."""
        from .implementation.checkpoint import load_checkpoint

        self.synchronize()  # an update in flight must not land on top of the loaded states
        load_checkpoint(self, path)
        self.skip_guard.last_checkpoint = (str(path), self.global_steps)

    # -- the full weights outside training (stage 3 holds only shards between forwards) ----------------------------
    def gathered_parameters(self, params=None, *, modifier_rank: int | None = None):
        """A context in which `params` (default: every parameter) hold their full weights on every rank.

        Every rank must enter it (at stage 3 it all-gathers). With `modifier_rank=r`, what rank r writes into
        the weights inside the block becomes every rank's weights and fp32 masters when it ends::

            with engine.gathered_parameters(modifier_rank=0):
                if rank == 0:
                    model.lm_head.weight.zero_()
        """
        self.synchronize()  # a delayed update in flight would land on top of what is read or written
        return self.states.gathered(params, modifier_rank=modifier_rank)

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full state_dict in the training precision, on the CPU, for inference or `save_pretrained`.

        Every rank must call it (at stage 3 each module's weights are gathered in turn)."""
        self.synchronize()
        with torch.no_grad():
            return {
                name: value.detach().to("cpu", copy=True) for name, value in self.model.state_dict().items()
            }

    # -- reporting -------------------------------------------------------------------------------------------------
    def timeline(self, path=None, *, title: str | None = None) -> list[list[Span]]:
        """The stages of the last steps (up to 16) on every rank, and with `path` their Gantt chart saved there.

        Every rank must call it (it gathers the ranks' spans); rank 0 draws."""
        return gather_timeline(self._timeline, self.comm, path, title=title)

    def memory_report(self) -> MemoryReport:
        """Model-state bytes per tier, estimated and measured, and the device's use and peak."""
        return MemoryReport(
            estimated=estimate_for_config(self.config, self.num_params, self.states),
            measured=self.ledger.measure(),
            device=self.accelerator.memory_stats(),
            accelerator=self.accelerator.name,
            num_params=self.num_params,
            host_staging=self.states.host_staging_bytes(),
        )


def initialize(model: torch.nn.Module, config, *, accelerator: Accelerator | None = None) -> Engine:
    """Wrap `model` in an engine configured by `config` (a dict, a path to a DeepSpeed-style JSON, or a Config).

    Under torchrun, a script that has not joined the process group is joined to it here, with the backend of
    the accelerator (gloo for the emulated device, NCCL for CUDA); the engine then owns that group."""
    backend = None if accelerator is None else ("nccl" if accelerator.device.type == "cuda" else "gloo")
    created_group = join_launcher_group(backend)
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    try:
        engine = Engine(model, load_config(config, world_size=world_size), accelerator=accelerator)
    except BaseException:
        if created_group:  # nobody else will use the group this call made: leave no gloo threads behind
            torch.distributed.destroy_process_group()
        raise
    engine._owns_process_group = created_group
    return engine
