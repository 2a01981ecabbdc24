"""Where an offloaded rank's model states live: the host's buffers and the device's.

OffloadedStates (offload.py) hands ShardedStates a `HostBuffers` as its placement, in place of the device-only
principles/device_buffers.DeviceBuffers: every unit's optimizer states and gradients on the host, or, with
module 4's partial offload (tuning/partial.py), only the leading `host_units` units there and the others on
the device, as ZeRO-2 would. The host units' fp32 master, m and v are a part of their own: `HostOptimizerStates`
here, in host memory for the whole run; module 5's NVMe tier (practice/nvme.py) passes its swap slots instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..accelerator import Accelerator
from ..basics.memory import MOMENT_DTYPES, held_bytes, moment_scales
from ..principles.device_buffers import device_weights, split_flat
from ..principles.partition import Unit
from .transfers import host_buffer


class HostOptimizerStates:
    """The host units' fp32 master weights and Adam's m and v, each one flat host buffer cut into units.

    `moments` ("fp32", "bf16" or "int8"; module 4's `zero_offload.cpu_adam.states`): how m and v are stored
    (basics/memory.py's MOMENT_DTYPES). int8 moments also keep one fp32 scale per block of each unit, in two
    more flat buffers (`exp_avg_scales`, `exp_avg_sq_scales`: a unit's scales, or None for fp32 and bf16). The
    master stays fp32 whatever the moments are: its small updates are what training is made of."""

    # The masters stay in host memory: fp32 training can upload from a master itself, with no staging copy.
    masters_stay_in_memory = True

    def __init__(self, accel: Accelerator, sizes: list[int], *, pin: bool, moments: str = "fp32"):
        self.moments = moments
        m_dtype, v_dtype = MOMENT_DTYPES[moments]
        # Zeroed: zero codes with zero scales are zero moments in every precision, the first step's.
        self.master = host_buffer(accel, sum(sizes), torch.float32, pin=pin)
        self.exp_avg = host_buffer(accel, sum(sizes), m_dtype, pin=pin)
        self.exp_avg_sq = host_buffer(accel, sum(sizes), v_dtype, pin=pin)
        self.master_params = split_flat(self.master, sizes)
        self.exp_avgs = split_flat(self.exp_avg, sizes)
        self.exp_avg_sqs = split_flat(self.exp_avg_sq, sizes)
        # Blocks are counted from each unit's first element: the C Adam updates one unit per call.
        counts = [moment_scales(size, moments) for size in sizes]
        self.scales = None  # (exp_avg's, exp_avg_sq's) flat scale buffers, int8 only
        self.exp_avg_scales = self.exp_avg_sq_scales = [None] * len(sizes)
        if sum(counts):
            self.scales = tuple(host_buffer(accel, sum(counts), torch.float32, pin=pin) for _ in range(2))
            self.exp_avg_scales, self.exp_avg_sq_scales = (split_flat(flat, counts) for flat in self.scales)

    def record(self, ledger) -> None:
        ledger.record("master_weights", self.master)
        ledger.record("exp_avg", self.exp_avg)
        ledger.record("exp_avg_sq", self.exp_avg_sq)
        if self.scales is not None:  # a moment's scales are part of it
            ledger.record("exp_avg", self.scales[0])
            ledger.record("exp_avg_sq", self.scales[1])


def host_unit_split(units: list[Unit], host_units: int | None) -> int:
    """How many leading units keep their optimizer on the host (None: all of them), checked."""
    if host_units is None:  # no partial offload asked for: every unit's optimizer on the host
        return len(units)
    if not 0 <= host_units <= len(units):
        raise ValueError(f"host_units must be 0 to {len(units)} (the units), got {host_units}")
    return host_units


class HostBuffers:
    """Every buffer of an offloaded rank's model states, placed on the host or the device, and its accounting.

    `host_units`: how many leading units are updated on the host (None: all). `offload_param` (stage 3): the
    fp16/bf16 weight shards on the host too. `pipelined`: module 5's pipeline stages the gradients through
    slots of its own, so there is no full-size gradient staging buffer. `host_optimizer(sizes)`: the host
    units' fp32 master, m and v (None: HostOptimizerStates). `moments`: how the host units' m and v are stored
    (module 4); units kept on the device keep fp32 moments, for torch's Adam there."""

    def __init__(
        self,
        units: list[Unit],
        accel: Accelerator,
        dtype: torch.dtype,
        *,
        stage: int,
        host_units: int | None = None,
        offload_param: bool = False,
        pin_param: bool = False,
        pin_optimizer: bool = False,
        pipelined: bool = False,
        host_optimizer: Callable[[list[int]], HostOptimizerStates] | None = None,
        moments: str = "fp32",
    ):
        self.accel, self.dtype, self.moments = accel, dtype, moments
        self.offload_param, self.pin_optimizer = offload_param, pin_optimizer
        self.host_units = host_unit_split(units, host_units)
        sizes = [u.shard_numel for u in units]
        host, device = sizes[: self.host_units], sizes[self.host_units :]
        self.host_fraction = sum(host) / sum(sizes)
        # Allocated in the order a GPU fills up: weights, gradients, then the optimizer's fp32 states.
        if offload_param:  # gather buffers are made one unit at a time, as ShardedStates sets up
            self.flat_param = host_buffer(accel, sum(sizes), dtype, pin=pin_param)
            self.full_params, self.param_shards = [], split_flat(self.flat_param, sizes)
        else:
            self.flat_param, self.full_params, self.param_shards = device_weights(units, accel, dtype, stage)
        self._place_gradients(host, device, pipelined)
        self._place_optimizer(host, device, host_optimizer)

    def _host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return host_buffer(self.accel, numel, dtype, pin=self.pin_optimizer)

    def _place_gradients(self, host: list[int], device: list[int], pipelined: bool) -> None:
        # Module 5's pipeline clears it when first used. Pageable, it takes no memory until then; pinned, it is
        # locked from the start.
        self.flat_grad = host_buffer(
            self.accel, sum(host), torch.float32, pin=self.pin_optimizer, zeroed=not pipelined
        )
        self.grad_staging = [] if pipelined else split_flat(self._host(sum(host), self.dtype), host)
        # Units updated on the device keep a gradient shard there, in the training precision, still scaled.
        self.device_grad = self.accel.zeros(sum(device), self.dtype, category="gradients")
        self.full_grads = None  # gradients leave the device as backward makes them, at every stage
        self.grad_shards = split_flat(self.flat_grad, host) + split_flat(self.device_grad, device)

    def _place_optimizer(self, host: list[int], device: list[int], host_optimizer) -> None:
        accel = self.accel
        # Even fp32 training keeps a separate fp32 master on the host: the device's copy is the one forward reads.
        self.optimizer = (host_optimizer or self._host_optimizer)(host)
        on_device = self.param_shards[self.host_units :]
        self.device_master = None  # fp32 weights on the device are their own master
        if self.dtype != torch.float32:
            self.device_master = accel.empty(sum(device), torch.float32, category="master_weights")
            on_device = split_flat(self.device_master, device)
        self.device_exp_avg = accel.zeros(sum(device), torch.float32, category="optimizer_states")
        self.device_exp_avg_sq = accel.zeros(sum(device), torch.float32, category="optimizer_states")
        optimizer = self.optimizer
        self.master, self.exp_avg, self.exp_avg_sq = optimizer.master, optimizer.exp_avg, optimizer.exp_avg_sq
        self.master_params = optimizer.master_params + on_device
        self.exp_avgs = optimizer.exp_avgs + split_flat(self.device_exp_avg, device)
        self.exp_avg_sqs = optimizer.exp_avg_sqs + split_flat(self.device_exp_avg_sq, device)
        self.exp_avg_scales = optimizer.exp_avg_scales + [None] * len(device)
        self.exp_avg_sq_scales = optimizer.exp_avg_sq_scales + [None] * len(device)
        # What publish() uploads from: the host shard itself (offload_param), the fp32 master (fp32 training,
        # while it stays in memory), or else a staging buffer of its own in the training precision.
        from_master = self.dtype == torch.float32 and optimizer.masters_stay_in_memory
        self.separate_param_staging = not self.offload_param and not from_master
        if self.offload_param:
            self.param_staging = self.param_shards[: self.host_units]
        elif from_master:
            self.param_staging = self.master_params[: self.host_units]
        else:
            self.param_staging = split_flat(self._host(sum(host), self.dtype), host)

    def _host_optimizer(self, sizes: list[int]) -> HostOptimizerStates:
        return HostOptimizerStates(self.accel, sizes, pin=self.pin_optimizer, moments=self.moments)

    # -- what the memory report counts ------------------------------------------------------------------------
    def record(self, ledger) -> None:
        ledger.record("parameters", self.flat_param)
        ledger.record("gradients", self.flat_grad)
        self.optimizer.record(ledger)
        ledger.record("gradients", self.device_grad)
        if self.device_master is not None:
            ledger.record("master_weights", self.device_master)
        ledger.record("exp_avg", self.device_exp_avg)
        ledger.record("exp_avg_sq", self.device_exp_avg_sq)

    def host_staging_bytes(self, also: list[torch.Tensor] = ()) -> int:
        """Host memory beyond the model states: the fp16 buffers gradients and weights pass through, and `also`
        (module 5's staging slots and the delayed update's two areas, which its pipeline holds)."""
        staging = [*self.grad_staging, *also]
        if self.separate_param_staging:
            staging += self.param_staging
        # Per storage, as the allocator holds it (pinned blocks are rounded up): views share their buffer.
        buffers = {t.untyped_storage().data_ptr(): held_bytes(t) for t in staging}
        return sum(buffers.values())
