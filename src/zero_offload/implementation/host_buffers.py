"""Where an offloaded rank's model states live: the host's buffers and the device's, for OffloadedStates.

OffloadedStates (offload.py) inherits this: every unit's optimizer states and gradients on the host, or, with
module 4's partial offload (tuning/partial.py), only the leading `host_units` units there and the others on
the device, as ZeRO-2 would. Module 5's NVMe tier (practice/nvme.py) replaces the optimizer's host buffers
with slots that swap to disk.
"""

from __future__ import annotations

import torch

from ..basics.memory import held_bytes
from ..principles.zero import ShardedStates
from .transfers import host_buffer


class HostBufferStates(ShardedStates):
    """ShardedStates with this rank's optimizer partition allocated on the host: the placement of every buffer,
    and its accounting. OffloadedStates sets `offload_param`, `pipelined`, the pin flags, `host_units` and
    `pipeline` (module 5) before these run."""

    # -- where each buffer lives -------------------------------------------------------------------------------
    def _host(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        return host_buffer(self.accel, numel, dtype, pin=pin)

    def _placement(self) -> tuple[list[int], list[int]]:
        """Shard sizes of the units whose optimizer is on the host, and of those whose optimizer is not."""
        sizes = [u.shard_numel for u in self.units]
        if self.host_units is None:  # no partial offload asked for: every unit's optimizer on the host
            self.host_units = len(sizes)
        if not 0 <= self.host_units <= len(sizes):
            raise ValueError(f"host_units must be 0 to {len(sizes)} (the units), got {self.host_units}")
        self.host_fraction = sum(sizes[: self.host_units]) / sum(sizes)
        return sizes[: self.host_units], sizes[self.host_units :]

    def _allocate_weights(self, full_numel: int, shard_numel: int) -> None:
        if not self.offload_param:
            return super()._allocate_weights(full_numel, shard_numel)
        self.flat_param = self._host(shard_numel, self.dtype, self.pin_param)
        self.param_shards = self._split(self.flat_param, [u.shard_numel for u in self.units])
        self.full_params = []  # gather buffers, made one unit at a time in _initialise

    def _allocate_gradients(self, full_numel: int, shard_numel: int) -> None:
        host, device = self._placement()
        # Module 5's pipeline clears it when first used. Pageable, it takes no memory until then; pinned, it is
        # locked (and rounded up to a power of two) from the start.
        if self.pipelined:
            self.flat_grad = host_buffer(
                self.accel, sum(host), torch.float32, pin=self.pin_optimizer, zeroed=False
            )
        else:
            self.flat_grad = self._host(sum(host), torch.float32, self.pin_optimizer)
        self.grad_staging = []
        if not self.pipelined:
            self.grad_staging = self._split(self._host(sum(host), self.dtype, self.pin_optimizer), host)
        # Units updated on the device keep a gradient shard there, in the training precision, still scaled.
        self.device_grad = self.accel.zeros(sum(device), self.dtype, category="gradients")
        self.grad_shards = self._split(self.flat_grad, host) + self._split(self.device_grad, device)

    def _allocate_optimizer_states(self, shard_numel: int) -> None:
        host, device = self._placement()
        # Even fp32 training keeps a separate fp32 master on the host: the device's copy is the one forward reads.
        self.master = self._host(sum(host), torch.float32, self.pin_optimizer)
        self.exp_avg = self._host(sum(host), torch.float32, self.pin_optimizer)
        self.exp_avg_sq = self._host(sum(host), torch.float32, self.pin_optimizer)
        on_device = self.param_shards[self.host_units :]
        self.device_master = None  # fp32 weights on the device are their own master
        if self.dtype != torch.float32:
            self.device_master = self.accel.empty(sum(device), torch.float32, category="master_weights")
            on_device = self._split(self.device_master, device)
        self.device_exp_avg = self.accel.zeros(sum(device), torch.float32, category="optimizer_states")
        self.device_exp_avg_sq = self.accel.zeros(sum(device), torch.float32, category="optimizer_states")
        self.master_params = self._split(self.master, host) + on_device
        self.exp_avgs = self._split(self.exp_avg, host) + self._split(self.device_exp_avg, device)
        self.exp_avg_sqs = self._split(self.exp_avg_sq, host) + self._split(self.device_exp_avg_sq, device)
        if self.offload_param or self.dtype == torch.float32:
            self.param_staging = self.master_params if not self.offload_param else self.param_shards
        else:
            self.param_staging = self._split(self._host(sum(host), self.dtype, self.pin_optimizer), host)
        self.param_staging = self.param_staging[: self.host_units]

    # -- what the memory report counts ------------------------------------------------------------------------
    def record(self, ledger) -> None:
        super().record(ledger)
        ledger.record("gradients", self.device_grad)
        if self.device_master is not None:
            ledger.record("master_weights", self.device_master)
        ledger.record("exp_avg", self.device_exp_avg)
        ledger.record("exp_avg_sq", self.device_exp_avg_sq)

    def host_staging_bytes(self) -> int:
        """Host memory beyond the model states: the fp16 buffers gradients and weights pass through."""
        staging = list(self.grad_staging)
        if self.pipeline is not None:  # module 5's staging slots and the delayed update's two areas
            staging += self.pipeline.staging_buffers()
        if not self.offload_param and self.dtype != torch.float32:
            staging += self.param_staging
        # Per storage, as the allocator holds it (pinned blocks are rounded up): views share their buffer.
        buffers = {t.untyped_storage().data_ptr(): held_bytes(t) for t in staging}
        return sum(buffers.values())
