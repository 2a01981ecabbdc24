"""ZeRO-Offload: the device computes, the host stores, PCIe carries (GPU 算、CPU 存、PCIe 传).

With `"offload_optimizer": {"device": "cpu"}` the fp32 half of the model states leaves the device:

  on the device:  the fp16/bf16 weights forward and backward read (2 bytes a parameter), and gradient buckets
                  while backward runs (principles/buckets.py);
  on the host:    this rank's partition of the fp32 master weights, Adam's m and v, and an fp32 gradient
                  partition (4 + 4 + 4 + 4 = 16 bytes per parameter of the shard), plus fp16 staging buffers.

One step, followed for one gradient (the Lab 3.x tasks in brackets):

  backward   bucket -> reduce-scatter -> this rank's fp16 shard --D2H, 2 bytes--> host staging
             -> fp32 gradient partition, divided by the loss scale                               [Lab 3.1]
  step       overflow on any rank? then skip on every rank                                       [Lab 3.4]
             clip factor -> Adam on the CPU over the flat fp32 partition                         [Lab 3.2]
             fp32 master -> fp16 on the host --H2D, 2 bytes--> device shard -> all-gather          [Lab 3.3]

Only fp16 crosses PCIe: 2 bytes per parameter each way, the 4 bytes a parameter of the ZeRO-Offload paper.
Stage 3 with `offload_param` goes further: the fp16 weight shards live on the host as well and cross PCIe
each time their layer is gathered (forward and again for backward).

The lab functions and the step are here; where each buffer lives (the host's and the device's allocations,
and their accounting) is host_buffers.HostBuffers, the placement OffloadedStates hands to ShardedStates.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..accelerator import Accelerator
from ..basics.norm import global_norm, squared_norm
from ..basics.precision import LOW_PRECISION, has_overflow, unscaled_fp32
from ..principles.comm import Comm
from ..principles.zero import ShardedStates, all_gather_unit
from .host_buffers import HostBuffers
from .transfers import Transfers


def gradients_to_host(
    transfers: Transfers,
    device_shard: torch.Tensor,
    host_staging: torch.Tensor,
    host_grad: torch.Tensor,
    inv_scale: float,
) -> None:
    """Move a reduced gradient shard to the host and add it, unscaled, into the fp32 gradient partition."""
    # Lab 3.1: copy the gradient partition to the host fp32 buffer (with the loss-scale factor)
    # `device_shard` is this rank's reduced fp16/bf16 gradient shard of one unit, on the device. Copy it, in its
    # own precision, into `host_staging` with transfers.to_host(...) (2 bytes a parameter cross the link, and
    # the copy is counted). Then ADD it into the fp32 `host_grad`, multiplied by `inv_scale` (1 / loss scale):
    # adding, because with gradient accumulation each micro-batch's shard arrives here in turn.
    raise NotImplementedError("Lab 3.1: copy the gradient partition to the host fp32 buffer (with the loss-scale factor)")


def adam_step(
    optimizer: torch.optim.Optimizer,
    masters: list[torch.Tensor],
    grads: list[torch.Tensor],
    clip_factor: float,
) -> None:
    """One Adam step over this rank's flat fp32 partition (given as its per-unit pieces).

    The engine calls this at every stage; with offload the partition, its gradients and the optimizer's
    moments are host tensors, so this is the step the CPU runs.
    """
    # Lab 3.2: the offloaded Adam step over the flat partition
    # `masters` are views of the host's flat fp32 master partition and `grads` the matching views of the fp32
    # gradient partition (already unscaled by Lab 3.1). Multiply the gradients in place by `clip_factor`
    # (1.0 when no clipping is needed), hand each one to its master weight as `.grad`, run optimizer.step()
    # (its moments are already host buffers: see the optimizer's state), then detach the gradients again
    # (set `.grad` back to None) so that nothing keeps a second reference to the partition.
    raise NotImplementedError("Lab 3.2: the offloaded Adam step over the flat partition")


class HostAdam:
    """The host's Adam over this rank's units: the whole partition at the step, or one unit as it arrives.

    Module 3's is torch's optimizer (`adam_step`, Lab 3.2): Adam on the fp32 masters, the rounding to fp16/bf16
    left to publish() (Lab 3.3). Module 4's C Adam (tuning/cpu_adam.py, OnePassAdam) does more in its one pass
    over the memory: it rounds into the staging buffer publish uploads, reads fp16/bf16 gradients as they came
    down the link, and sums the gradient's norm on the way. The capabilities say which of these it does.
    """

    rounds_in_pass = False  # step() leaves every unit's rounded weights in the states' staging buffers
    reads_low_precision_grads = False  # update() may be given the fp16/bf16 staging slot as its gradient
    sums_norm = False  # update(norm=True) returns the gradient's squared norm, summed in the same pass

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def step(self, states, grads: list[torch.Tensor], clip_factor: float, units=None, norms=None) -> bool:
        """Adam over the host's units of `states` (or only `units`, indices), each with its fp32 gradient.

        Returns whether it also wrote the rounded fp16/bf16 weights into the staging buffers: never here,
        publish() rounds them (Lab 3.3); the caller passes the answer on to publish(rounded=...)."""
        masters = states.master_params
        chosen = range(len(grads)) if units is None else units
        adam_step(self.optimizer, [masters[i] for i in chosen], [grads[i] for i in chosen], clip_factor)
        return False

    def update(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        out: torch.Tensor | None,
        clip_factor: float,
        *,
        norm=False,
    ) -> float | None:
        """Adam on one unit, then its weights rounded into `out` (None: nothing to round, fp32 or in place)."""
        adam_step(self.optimizer, [master], [grad], clip_factor)
        if out is not None:
            out.copy_(master)
        return None


def upload_weights(
    transfers: Transfers, master: torch.Tensor, host_low: torch.Tensor, device_shard: torch.Tensor
) -> None:
    """Round the updated fp32 master shard to fp16/bf16 on the host and copy it to the device shard."""
    # Lab 3.3: cast and upload the updated weights
    # Write the fp32 `master` into `host_low` (the host's fp16/bf16 staging buffer: copy_ rounds to nearest
    # even), THEN copy `host_low` to `device_shard` with transfers.to_device(...), so 2 bytes a parameter cross
    # the link, not 4. In fp32 training `host_low` is `master` itself: skip the cast.
    raise NotImplementedError("Lab 3.3: cast and upload the updated weights")


def overflow_on_any_rank(comm: Comm, host_grad: torch.Tensor) -> bool:
    """True on every rank if any rank's fp32 gradient partition holds an inf or a nan."""
    # Lab 3.4: overflow across ranks: skip everywhere, lose nothing
    # Each rank sees only its own partition, but the decision to skip must be the same everywhere: a rank
    # that stepped while another skipped would hold weights the others never see again. Check `host_grad`
    # for any non-finite value (inf AND nan), then return comm.any(...) of that local flag.
    raise NotImplementedError("Lab 3.4: overflow across ranks: skip everywhere, lose nothing")


class _Landing:
    """A stage-3 gather issued on the parameter-upload stream: wait() orders the compute stream after it."""

    def __init__(self, work, landed, accel: Accelerator):
        self.work, self.landed, self.accel = work, landed, accel

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()  # NCCL: the current stream waits for the collective, queued after the upload
        self.accel.compute_waits(self.landed)
        return True


class OffloadedStates(ShardedStates):
    """ZeRO stage 1-3 with the optimizer (and at stage 3 optionally the weights) on the host.

    Every unit's optimizer states and gradients live on the host. Module 4's partial offload
    (tuning/partial.py, host_unit_count) passes `host_units`: only that many leading units there and the others
    on the device, as ZeRO-2 would; the code below handles both. Module 4 may also store the host's m and v
    below fp32 (`moments`: "bf16" or "int8", for its C Adam). Where each buffer is allocated, and how the memory
    report counts it, is `self.buffers`, a host_buffers.HostBuffers; `host_optimizer` (module 5's NVMe tier)
    replaces the host units' fp32 master, m and v in it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        accel: Accelerator,
        precision: str,
        stage: int,
        comm: Comm,
        zero,
        *,
        loss_scale: Callable[[], float],
        pipelined: bool = False,
        host_units: int | None = None,
        host_optimizer=None,
        group_of: dict[int, int] | None = None,
        moments: str = "fp32",
    ):
        placement = functools.partial(
            HostBuffers,
            accel=accel,
            dtype=LOW_PRECISION[precision],
            stage=stage,
            host_units=host_units,  # None: every unit
            offload_param=zero.offload_param.enabled,
            pin_param=zero.offload_param.pin_memory,
            pin_optimizer=zero.offload_optimizer.pin_memory,
            # Module 5's pipeline stages gradients through slots of its own: no full-size staging buffer here.
            pipelined=pipelined,
            host_optimizer=host_optimizer,
            moments=moments,  # module 4: the host's m and v in fp32, bf16 or 8 bits
        )
        # Gradients leave the device as backward makes them, at every stage.
        super().__init__(
            model,
            accel,
            precision,
            stage,
            comm,
            zero,
            partition_gradients=True,
            place_buffers=placement,
            group_of=group_of,
        )
        buffers = self.buffers
        self.host_units, self.host_fraction = buffers.host_units, buffers.host_fraction
        self.offload_param, self.pin_optimizer = buffers.offload_param, buffers.pin_optimizer
        self.param_staging = buffers.param_staging  # what publish() uploads from (host_buffers.py)
        self.transfers = Transfers(accel, timeline=comm.timeline)
        self.loss_scale = loss_scale  # read as each shard arrives: gradients reach the host unscaled
        self._uploads: dict[int, torch.Tensor] = {}  # stage 3: shards on their way to a gather
        # Stage 3 with offload_param: each gather's upload and all-gather queue on a stream of their own, so the
        # copy hides behind compute and only the unit's reader waits for it.
        self._param_stream = accel.new_stream("zo-param-h2d") if self.offload_param else None
        # Module 5's overlapped pipeline (practice/pipeline.py), when on: it moves the host units' gradients
        # down during backward and their weights up after Adam, and says which units it has published.
        self.pipeline = None

    def hand_gradients_to(self, pipeline) -> None:
        """From now on the host units' gradient shards go to `pipeline` (module 5) as they are reduced, and it
        rounds and uploads the weights of the units it updates."""
        self.pipeline = pipeline

    # -- backward: each reduced shard crosses to the host ------------------------------------------------------
    def _deliver_gradient(self, index: int, shard: torch.Tensor) -> None:
        if index >= self.host_units:  # updated on the device: accumulate there, as ZeRO-2 does
            return super()._deliver_gradient(index, shard)
        if self.pipeline is not None:  # module 5: queued, backward goes on while it crosses
            return self.pipeline.receive(index, shard)
        staging = self.buffers.grad_staging[index]
        gradients_to_host(self.transfers, shard, staging, self.grad_shards[index], 1.0 / self.loss_scale())

    # -- stage 3 with offload_param: a shard crosses PCIe each time its unit is gathered ----------------------
    def _shard_on_device(self, index: int) -> torch.Tensor:
        if not self.offload_param:
            return super()._shard_on_device(index)
        upload = self.accel.empty(self.units[index].shard_numel, self.dtype, category="buckets")
        self.transfers.to_device(upload, self.param_shards[index])
        self._uploads[index] = upload  # alive until the gather that reads it has finished
        return upload

    def _start_gather(self, index: int, *, async_op: bool):
        if self._param_stream is None:
            return super()._start_gather(index, async_op=async_op)
        with self.accel.issuing_on(self._param_stream):
            work = super()._start_gather(index, async_op=async_op)
            landed = self.accel.record_event()  # on the upload stream: the copy and a one-rank "gather"
        if not async_op:
            self.accel.compute_waits(landed)
            return None
        return _Landing(work, landed, self.accel)

    def _gather_landed(self, index: int) -> None:
        self._uploads.pop(index, None)  # the gather that read this upload has finished

    # -- the step ---------------------------------------------------------------------------------------------
    def overflow(self) -> bool:
        on_host = overflow_on_any_rank(self.comm, self.flat_grad)
        if self.host_units == len(self.units):
            return on_host
        # Every rank asks both: the collectives pair up.
        on_device = self.comm.any(has_overflow(self.buffers.device_grad))
        return on_host or on_device

    def fp32_gradients(self, inv_scale: float) -> list[torch.Tensor]:
        if self.pipeline is not None:
            self.pipeline.define_gradients()
        host = self.grad_shards[: self.host_units]  # fp32 already, and unscaled on arrival (Lab 3.1)
        if self.host_units == len(self.units):
            return host
        # The units updated on the device.
        device = unscaled_fp32(self.accel, self.buffers.device_grad, inv_scale)
        return host + self._split(device, [u.shard_numel for u in self.units[self.host_units :]])

    def after_backward(self) -> None:
        super().after_backward()
        if self.pipeline is not None:  # every gradient on the host (and, eager, every unit updated)
            self.pipeline.wait()

    def publish(self, *, rounded: bool = False) -> None:
        """The new weights where forward reads them. `rounded`: the host's Adam already wrote the host units'
        rounded weights into the staging buffers (module 4's one pass), so they only need the upload."""
        uploaded = self.pipeline.published_units() if self.pipeline is not None else set()
        for index in range(len(self.units)):
            if index in uploaded:  # module 5's pipeline did the rounding and upload
                if self.offload_param:
                    continue
            elif index >= self.host_units:  # updated on the device: round there, nothing crosses the link
                if self.buffers.device_master is not None:
                    self.param_shards[index].copy_(self.master_params[index])
            elif self.offload_param:  # the weights stay on the host: round into the host shard, no upload
                if not rounded:
                    self.param_shards[index].copy_(self.master_params[index])
                continue
            elif rounded:  # the one-pass update already rounded them into the staging buffer: upload only
                self.transfers.to_device(self.param_shards[index], self.param_staging[index])
            else:
                upload_weights(
                    self.transfers,
                    self.master_params[index],
                    self.param_staging[index],
                    self.param_shards[index],
                )
            if self.stage < 3:
                all_gather_unit(self.comm, self.full_params[index], self.param_shards[index])

    def grad_norm(self, grads: list[torch.Tensor]) -> float:
        # Module 5: the host summed each of its units' squares as the gradient arrived; the same numbers in
        # the same order as the loop over `grads` would give.
        squares = self.pipeline.squared_norms if self.pipeline is not None else {}
        local = (squares[i] if i in squares else squared_norm(g) for i, g in enumerate(grads))
        return global_norm(local, self.comm.sum)

    def close(self) -> None:
        if self._param_stream is not None:
            self._param_stream.close()

    def zero_grad(self) -> None:
        if self.pipeline is not None:
            self.pipeline.zero_grad()
        else:
            self.flat_grad.zero_()
        self.buffers.device_grad.zero_()

    # -- what the memory report counts (host_buffers.py) -------------------------------------------------------
    def host_staging_bytes(self) -> int:
        """Host memory beyond the model states: the staging buffers, the placement's and module 5's pipeline's."""
        pipeline_staging = self.pipeline.staging_buffers() if self.pipeline is not None else []
        return self.buffers.host_staging_bytes(pipeline_staging)
