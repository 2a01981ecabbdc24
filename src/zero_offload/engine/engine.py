"""The engine: composes the pieces of the five modules into `forward`, `backward`, `step`.

It keeps the training loop's logic: loss scaling, gradient accumulation, skipping a step with an inf or nan in
any precision and stopping a run that keeps skipping (divergence.py), and the bookkeeping of each step. The rest
it hands to two objects:

    states           where the model states live (states.py): module 1's MixedPrecisionStates at stage 0,
                     module 2's ShardedStates, module 3's OffloadedStates, module 4's partial offload and
                     module 5's NVMe tier
    optimizer_step   who runs Adam, when and on which cores (optimizer_step.py): serially, module 5's
                     overlapped pipeline, its delayed update; with the clip factor and the learning-rate schedule

so one `step` reads the same for every configuration: reduce, overflow, `optimizer_step.step`, record.
"""

from __future__ import annotations

import atexit
import os
import weakref

import torch

from ..accelerator import Accelerator, HintOnOutOfMemory, get_accelerator
from ..basics.memory import MemoryLedger, MemoryReport
from ..basics.precision import DynamicLossScaler, StaticLossScaler, unique_parameters
from ..config import Config, check_supported, load_config
from ..implementation.checkpoint import LoadOptions, load_checkpoint, save_checkpoint
from ..implementation.schedulers import build_scheduler
from ..practice.timeline import Span, Timeline, gather_timeline
from ..principles.comm import Comm
from ..principles.process_group import JoinedGroup, hold_launcher_group
from ..principles.recompute import checkpoint_blocks
from ..tuning.moment_codec import MomentCodec
from ..tuning.partial import estimate_for_config
from .divergence import SkipGuard
from .model_setup import (
    check_loss,
    check_same_parameters,
    install_upcast_hooks,
    place_buffers_and_frozen,
    to_device,
    warn_unstepped,
)
from .optimizer_step import OptimizerStep
from .optimizers import build_optimizers
from .param_groups import group_fingerprint, resolve_param_groups
from .states import build_states

# Engines not closed yet. At exit they are closed, so that a script which never calls engine.close() still ends
# cleanly (no thread of the engine's running, the group it joined destroyed) while the interpreter is whole.
_open_engines: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def close_open_engines() -> None:
    for engine in list(_open_engines):
        engine.close()


def engine_of(params) -> Engine:
    """The open engine that trains `params` (parameters of its model); a clear error if none does."""
    wanted = {id(p) for p in params}
    for engine in list(_open_engines):
        if wanted and wanted <= {id(p) for p in engine.model.parameters()}:
            return engine
    raise ValueError(
        "these parameters belong to no open engine's model: build the engine first (zo.initialize or "
        "zero_offload.deepspeed.initialize), and pass parameters of the model it was given"
    )


class Engine:
    """Trains `model` as the config says. Use it as `loss_fn(engine(x), y)`, `engine.backward(loss)`, `engine.step()`."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: Config,
        *,
        accelerator: Accelerator | None = None,
        joined_group: JoinedGroup | None = None,
        param_groups=None,
    ):
        check_supported(config)
        self._closed = False
        # The group zo.initialize joined for the script, held while this engine is open: close() lets go of it.
        self._joined_group = joined_group
        self.config, self.model = config, model
        self.accelerator = accelerator or get_accelerator(config.zero_offload.device_memory)
        # An accelerator may serve several engines in turn (gpu-check reuses one): each reports its own peak.
        self.accelerator.reset_peak()
        # Module 5: when each stage ran (practice/timeline.py). The comm records its collectives in it, and the
        # offloaded states' transfers, which take it from the comm, record their copies.
        self._timeline = Timeline(accelerator=self.accelerator)
        self.comm = Comm(timeline=self._timeline)
        if self.comm.world_size != config.world_size:
            raise ValueError(
                f"the config was loaded for {config.world_size} rank(s) but {self.comm.world_size} are running; "
                "pass the config through zo.initialize so that it reads the world size itself"
            )
        self.comm.check_same("configs", config.fingerprint())
        check_same_parameters(self.comm, model)  # before the states' collectives, which would mispair
        if not unique_parameters(model):
            raise ValueError("the model has no trainable parameters")
        # Which parameters Adam updates with which settings (param_groups.py): the script's, else one group.
        self.groups = resolve_param_groups(model, param_groups, config.optimizer)
        self.comm.check_same(
            "parameter groups",
            group_fingerprint(self.groups, model),
            "Build the same parameter groups, with the same settings, on every rank.",
        )
        # bf16 and fp32 have fp32's exponent range: no scaling.
        self.scaler = (
            DynamicLossScaler.from_config(config.fp16) if config.fp16.enabled else StaticLossScaler(1.0)
        )
        # Where the model states live (states.py): one states object of modules 1 to 5.
        self.states = build_states(
            model,
            config,
            self.accelerator,
            self.comm,
            loss_scale=lambda: self.scaler.scale,
            groups=self.groups,
        )
        self.params, self.num_params = self.states.params, self.states.numel
        place_buffers_and_frozen(model, self.accelerator, self.states.dtype)
        offloaded = config.zero_optimization.stage > 0 and config.zero_optimization.offload_optimizer.enabled
        optimizers = build_optimizers(config, self.states, self.groups, offloaded=offloaded)
        self.optimizer = optimizers.optimizer
        # How checkpoints read and write m and v in the precision they are kept in (module 4: fp32, bf16, 8 bits).
        self.moment_codec = MomentCodec()
        self.lr_scheduler = build_scheduler(config.scheduler, self.optimizer)
        self.ledger = MemoryLedger(self.accelerator)
        self.states.record(self.ledger)
        if self.accelerator.compute_dtype(self.states.dtype) != self.states.dtype:
            install_upcast_hooks(model, self.accelerator)
        if config.activation_checkpointing.enabled:
            checkpoint_blocks(model, self.accelerator, self.states.dtype)
        # Counts the skips in a row nothing cures and stops the run at zero_offload.max_skipped_steps.
        self.skip_guard = SkipGuard(config.zero_offload.max_skipped_steps, fp16=config.fp16.enabled)
        # Who runs Adam, when and on which cores (optimizer_step.py): the updaters, module 5's pipeline and its
        # delayed update.
        self.optimizer_step = OptimizerStep(
            config,
            self.states,
            self.accelerator,
            self.comm,
            optimizers=optimizers,
            scaler=self.scaler,
            skip_guard=self.skip_guard,
            timeline=self._timeline,
            lr_scheduler=self.lr_scheduler,
        )
        self.micro_steps = 0  # backward calls so far
        self.global_steps = 0  # optimizer steps taken or skipped
        self.skipped_steps = 0
        self._boundary_at: int | None = None  # global_steps when backward last closed a window: step() is due
        self._warned_unstepped = False
        # One entry per optimizer step: loss scale, overflow, gradient norm, learning rate, Adam's seconds.
        self.history: list[dict] = []
        _open_engines.add(self)

    # -- forward ---------------------------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self._closed:
            raise RuntimeError("this engine was closed (engine.close()); make a new one with zo.initialize")
        # The inputs and what forward keeps for backward grow with the micro-batch: that is the hint. A gather or
        # a bucket that runs out in forward has named its own setting already, and keeps it.
        with HintOnOutOfMemory("activations"):
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
        check_loss(loss)
        if self._boundary_at == self.global_steps and not self._warned_unstepped:
            self._warned_unstepped = True
            warn_unstepped(self.gradient_accumulation_steps)
        last = (self.micro_steps + 1) % self.gradient_accumulation_steps == 0
        self.optimizer_step.begin_backward(last=last, step=self.global_steps)
        skip = self.skip_guard.skips_backward(loss, self.comm)  # bf16/fp32: a non-finite loss on any rank
        self.states.before_backward()  # and after_backward: stage 3 releases what forward gathered
        if not skip:
            # Autograd's own buffers (activation gradients, recomputed layers) run out here, with torch's bare text.
            with self._timeline.span("backward"), HintOnOutOfMemory("activations"):
                (loss.float() * (self.scaler.scale / self.gradient_accumulation_steps)).backward()
        self.states.after_backward()
        self.micro_steps += 1
        self._boundary_at = self.global_steps if self.is_gradient_accumulation_boundary() else None

    def step(self) -> None:
        """At an accumulation boundary: reduce, check overflow, unscale, clip, update, publish; else nothing."""
        if self.micro_steps == 0 or not self.is_gradient_accumulation_boundary():
            return
        self.states.reduce_gradients()
        skip = self.skip_guard.take_window_skip()
        if self.config.fp16.enabled and self.states.overflow():  # true on every rank if true on any
            skip = "fp16 overflow"
        record = {
            "step": self.global_steps,
            "loss_scale": self.scaler.scale,
            "overflow": skip is not None,
            "skipped": skip,  # why the step was skipped: fp16 overflow, non-finite loss or gradient norm
            "grad_norm": None,
            "lr": self.optimizer.param_groups[0]["lr"],
            "adam_seconds": 0.0,
        }
        # The clip factor, Adam, the new weights published, the schedule (optimizer_step.py).
        # An allocation of the states names its own setting; what else runs out here is the step's temporaries.
        with HintOnOutOfMemory("the optimizer step"):
            skip = self.optimizer_step.step(self.global_steps, record, skip)
        record.update(overflow=skip is not None, skipped=skip)
        self.skipped_steps += skip is not None
        diverged = self.skip_guard.after_step(
            self.global_steps + 1, skip, self.scaler
        )  # before the scale moves
        self.scaler.update(skip is not None)
        self.states.zero_grad()
        self.accelerator.fence_copies()  # the user's next write to a parameter lands after this step's uploads
        self.global_steps += 1
        self._timeline.begin_step(self.global_steps)
        self.history.append(record)
        if diverged is not None:
            raise diverged

    def synchronize(self) -> None:
        """Finish a delayed update still in flight and publish its weights. Forward then reads them one step
        earlier than it would have; a checkpoint does not call this, so that saving leaves the run as it was."""
        self.optimizer_step.synchronize()

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
                    self.states.gathering.release(index)  # waits for a prefetch still in flight
        finally:
            self.optimizer_step.close()
            self.states.close()
            if self._joined_group is not None:  # the group goes with the last engine that holds it
                self._joined_group.release()

    def destroy(self) -> None:
        """DeepSpeed's name for close(): a DeepSpeed script that ends with engine.destroy() ends the same here."""
        self.close()

    # -- checkpoints (implementation/checkpoint.py) ------------------------------------------------------------------
    def save_checkpoint(
        self, path, tag: str | None = None, client_state: dict | None = None, save_latest=True
    ):
        """Every rank writes its shard of the model states, with what it takes to resume, into directory `path`
        (into its folder `tag`, by default the step; `path/latest` names the newest complete one, unless
        `save_latest=False`). `client_state`: the script's own plain values, given back by load_checkpoint.

        Saving does not change the run: a delayed update in flight lands but is published at the next step, as
        it would have been without the save (practice/dpu.py)."""
        save_checkpoint(self, path, tag, client_state=client_state, save_latest=save_latest)
        self.skip_guard.remember_checkpoint(path, self.global_steps)  # what a diverged run goes back to

    def load_checkpoint(
        self,
        path,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str, dict]:
        """Resume from `path` (its save `tag`, by default the one `latest` names), saved by any world size:
        shards are re-cut for this one. Returns the save's folder and the `client_state` it was saved with.

        `load_optimizer_states=False`: the weights and the counters, with Adam starting afresh;
        `load_module_only=True`: the weights alone (step counters, schedule and loss scale stay this engine's)."""
        self.synchronize()  # an update in flight must not land on top of the loaded states
        options = LoadOptions(load_optimizer_states, load_lr_scheduler_states, load_module_only)
        loaded = load_checkpoint(self, path, tag, options)
        state = loaded.training
        if state is not None:
            if state.scaler_state is not None:
                self.scaler.load_state_dict(state.scaler_state)
            self.global_steps, self.micro_steps = state.global_steps, state.micro_steps
            self.skipped_steps, self.history = state.skipped_steps, state.history
            self.skip_guard.resume(state.skipped_in_a_row)
            self.skip_guard.remember_checkpoint(path, self.global_steps)
        return str(loaded.folder), loaded.client_state

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

    # -- what a DeepSpeed script asks of its engine, with DeepSpeed's meaning -----------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.model

    @property
    def device(self) -> torch.device:
        """Where forward's inputs go: `batch.to(engine.device)`."""
        return self.accelerator.device

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine (torchrun's LOCAL_RANK; 0 without a launcher)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    def train(self, mode: bool = True) -> Engine:
        self.model.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group, as the next step will use it."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    # -- reporting -------------------------------------------------------------------------------------------------
    def timeline(self, path=None, *, title: str | None = None, trace=None) -> list[list[Span]]:
        """The stages of the last steps (up to 16) on every rank; with `path` their Gantt chart saved there, with
        `trace` a Chrome/Perfetto trace (JSON trace events: open it in ui.perfetto.dev or chrome://tracing).

        Every rank must call it (it gathers the ranks' spans); rank 0 draws and writes."""
        return gather_timeline(self._timeline, self.comm, path, title=title, trace=trace)

    def memory_report(self) -> MemoryReport:
        """Model-state bytes per tier, estimated and measured, and the device's use and peak."""
        return MemoryReport(
            estimated=estimate_for_config(self.config, self.num_params, self.states),
            measured=self.ledger.measure(),
            device=self.accelerator.memory_stats(),
            accelerator=self.accelerator.name,
            num_params=self.num_params,
            host_staging=self.states.host_staging_bytes(),
            # This rank's fp32 master elements (its shard, padding included): what bytes a parameter count per.
            optimizer_numel=sum(master.numel() for master in self.states.master_params),
        )


def initialize(
    model: torch.nn.Module, config, *, accelerator: Accelerator | None = None, param_groups=None
) -> Engine:
    """Wrap `model` in an engine configured by `config` (a dict, a path to a DeepSpeed-style JSON, or a Config).

    `param_groups`: torch.optim-style groups of the model's parameters, e.g. `[{"params": decay,
    "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]`, each with its own lr, betas, eps and
    weight_decay (those it leaves out are the config's); every trainable parameter in exactly one group.

    Under torchrun, a script that has not joined the process group is joined to it here, with the backend of
    the accelerator (gloo for the emulated device, NCCL for CUDA); the engine then holds that group."""
    backend = None if accelerator is None else ("nccl" if accelerator.device.type == "cuda" else "gloo")
    joined_group = hold_launcher_group(backend)
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    try:
        return Engine(
            model,
            load_config(config, world_size=world_size),
            accelerator=accelerator,
            joined_group=joined_group,
            param_groups=param_groups,
        )
    except BaseException:
        # No engine holds the group for this call: if nobody else does, leave no gloo threads behind.
        if joined_group is not None:
            joined_group.release()
        raise
