"""A performance model of ZeRO(-Offload) training (the advisor built on it is advisor.py).

For a model of P parameters on a host with N GPUs (one rank each, shard = P / N), one training step costs:

  compute    6 * P * tokens FLOPs (forward 2, backward 4 per parameter and token; 8 with activation
             recomputation, which runs forward twice), at gpu_tflops * mfu. Attention's own FLOPs are left out.
  GPU Adam   the part of the optimizer step on the device: 28 bytes of HBM traffic a parameter
             (read weight, gradient, m, v; write weight, m, v, all fp32), at the HBM bandwidth.
  comm       GPU-to-GPU (NVLink): reduce-scatter + all-gather, 2 (N-1)/N * P 16-bit values a step (as one
             all-reduce); stage 3 gathers the weights twice (forward and backward): 3 (N-1)/N.
  PCIe       offload_optimizer: the rank's fp16 gradients down (D2H) and fp16 weights up (H2D), 2 bytes a
             parameter of its shard each way; offload_param: the weights go up for every gather (2 + 2) and
             never come back. PCIe is full duplex and link_gb_per_s is per direction: down and up each take
             their bytes / link_gb_per_s, on their own copy engine.
  CPU Adam   step_seconds + calls * call_seconds + params_on_host * seconds a parameter (a start-up cost
             once a step, one per tensor, then the elements). A parameter whose states come from memory
             takes 1 / the rank's throughput: its threads' own speed, at most its share of its socket's
             (hardware.py: NUMA). One whose states are still in the last-level cache from the step before
             takes 1 / the cached speed; the share of them still cached falls linearly from all (tiny states)
             to none (the host's states as large as the cache_bytes calibrate() measured). With m and v
             stored in bf16 or 8 bits (Workload.moments) the pass from memory moves fewer bytes and is taken
             to be that much faster (cpu_adam_seconds).

Two schedules bound a real step. `serial` (this engine up to module 4) adds every part up: the gradients go
down, then the CPU steps, then the weights go up, so down and up never run at once and PCIe counts
(down + up) / link. `overlapped` is the busiest resource alone (module 5's pipeline with the delayed
parameter update): this step's gradients go down during its backward while the weights of the step before
go up, on the two directions of the link at once, so PCIe counts max(down, up) / link; every copy,
collective and the CPU step hide behind compute. Memory per tier comes from basics.estimate_model_states,
plus activations, working buffers and the host's fp16 staging buffers. The hardware (presets, calibration)
is hardware.py; tensor and pipeline parallelism and several hosts (`layout`) are parallel.py, rough.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..basics.memory import (
    MOMENT_PRECISIONS,
    QUANT_BLOCK,
    ModelStateBytes,
    estimate_model_states,
    moment_bytes,
)
from .bandwidth import ENGINE_FORM, FORM_BYTES, STATE_BYTES
from .hardware import ADAM_BYTES_PER_PARAM, PRESET_NAMES, PRESETS, Hardware, calibrate, hardware_preset
from .parallel import Layout, activation_factor, bubble_share, dp_link_gb_per_s, model_parallel_seconds
from .partial import estimate_partial_offload

# The hardware's names are re-exported: `from zero_offload.tuning.perfmodel import PRESETS, calibrate` works.
__all__ = ["ADAM_BYTES_PER_PARAM", "DEVICE_RESERVE", "HOST_RESERVE", "LOW_BYTES", "Layout", "OFFLOADS", "PRESETS",
           "PRESET_NAMES", "Hardware", "Plan", "StepTime", "Workload", "cached_share", "calibrate",
           "cpu_adam_seconds", "hardware_preset", "plan", "plan_all"]  # fmt: skip

LOW_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
OFFLOADS = ("none", "optimizer", "optimizer+param")
DEVICE_RESERVE = 0.08  # CUDA context, allocator fragmentation and communication buffers
HOST_RESERVE = 0.10  # the OS, the data loader and the Python processes themselves


@dataclass(frozen=True)
class Workload:
    """What is trained: P parameters, a micro-batch of `batch` sequences of `seq_len` tokens per GPU."""

    params: int
    batch: int = 1
    seq_len: int = 1024
    precision: str = "fp16"
    recompute: bool = False  # activation checkpointing: keep layer inputs, recompute the rest in backward
    hidden: int | None = None  # None: from P, with GPT-3's proportions (hidden = 128 x layers)
    layers: int | None = None
    units: int | None = None  # tensors the CPU Adam updates, one call each; None: 6 per layer + 3
    bucket_numel: int = 500_000_000  # reduce_bucket_size: gradients wait in such buckets on the device
    moments: str = "fp32"  # how the host's Adam stores m and v: "fp32", "bf16" or "int8" (cpu_adam.states)

    def __post_init__(self):
        if self.params < 1 or self.batch < 1 or self.seq_len < 1:
            raise ValueError("params, batch and seq_len must each be at least 1")
        if self.precision not in LOW_BYTES:
            raise ValueError(f"precision must be one of {', '.join(LOW_BYTES)}; got {self.precision!r}")
        if self.moments not in MOMENT_PRECISIONS:
            raise ValueError(f"moments must be one of {', '.join(MOMENT_PRECISIONS)}; got {self.moments!r}")

    def shape(self) -> tuple[int, int]:
        """(hidden, layers): a GPT block has 12 hidden^2 parameters; GPT-3's models keep hidden near 128 x layers."""
        hidden = self.hidden or max(64, round((128 * self.params / 12) ** (1 / 3)))
        layers = self.layers or max(1, round(self.params / (12 * hidden * hidden)))
        return hidden, layers

    @property
    def tensor_calls(self) -> int:
        return self.units or 6 * self.shape()[1] + 3

    def activation_bytes(self) -> int:
        """Activations kept for backward on one GPU: about 34 x seq x batch x hidden bytes a layer in 16 bits
        (Korthikanti et al. 2022, attention scores not kept, as with fused attention). Recomputation keeps
        each layer's 16-bit input and one layer's full set while it is recomputed."""
        hidden, layers = self.shape()
        per_token = self.seq_len * self.batch * hidden * LOW_BYTES[self.precision] / 2
        if self.recompute:
            return int(per_token * (2 * layers + 34))
        return int(per_token * 34 * layers)


@dataclass(frozen=True)
class StepTime:
    """Seconds a step keeps each resource busy; PCIe in each direction apart (its two directions overlap)."""

    compute: float
    gpu_adam: float
    comm: float
    pcie_down: float  # gradients, device to host
    pcie_up: float  # weights, host to device
    cpu_adam: float
    model_parallel: float = 0.0  # TP all-reduces and PP sends (parallel.py), on the GPU's critical path
    bubble: float = 0.0  # the pipeline's idle time (parallel.py)

    @property
    def pcie(self) -> float:
        """The copies one after the other, as the serial step runs them."""
        return self.pcie_down + self.pcie_up

    @property
    def pcie_duplex(self) -> float:
        """The copies with both directions of the link at work at once, as the overlapped step runs them."""
        return max(self.pcie_down, self.pcie_up)

    @property
    def serial(self) -> float:
        return (
            self.compute
            + self.gpu_adam
            + self.comm
            + self.pcie
            + self.cpu_adam
            + self.model_parallel
            + self.bubble
        )

    def busy(self) -> dict[str, float]:
        gpu = self.compute + self.gpu_adam + self.model_parallel + self.bubble
        return {"GPU": gpu, "GPU-GPU": self.comm, "PCIe": self.pcie_duplex, "CPU Adam": self.cpu_adam}

    @property
    def overlapped(self) -> float:
        return max(self.busy().values())

    @property
    def bottleneck(self) -> str:
        busy = self.busy()
        return max(busy, key=busy.get)


@dataclass(frozen=True)
class Plan:
    """One configuration (ZeRO stage x offload choice) evaluated on one hardware and workload."""

    stage: int
    offload: str  # one of OFFLOADS
    ratio: float  # share of the optimizer step run on the host (offload_optimizer.ratio); 0 without offload
    states: ModelStateBytes  # one rank's model states per tier
    activations: int
    buffers: int  # gradient buckets (and stage 3's gather buffers) on the device
    staging: int  # one rank's 16-bit host buffers that gradients and weights pass through
    device_bytes: int  # per GPU: states + activations + buffers
    host_bytes: int  # one host: its ranks' states and staging
    device_usable: int
    host_usable: int
    pcie_bytes: int  # per rank and step, both directions
    time: StepTime
    layout: Layout = Layout()

    @property
    def fits(self) -> bool:
        return self.device_bytes <= self.device_usable and self.host_bytes <= self.host_usable

    @property
    def preference(self) -> tuple:
        """How a recommendation ranks plans (smallest first): fastest; among equals the one that leaves the most
        device memory (for a larger batch), then stage 2, the stage ZeRO-Offload was built on, then the lower."""
        return (float(f"{self.time.serial:.3g}"), self.device_bytes, self.stage != 2, self.stage)

    @property
    def label(self) -> str:
        text = f"stage {self.stage}" + ("" if self.offload == "none" else f" + {self.offload} offload")
        return text + (f" (ratio {self.ratio:g})" if 0 < self.ratio < 1 else "")


def cached_share(hw: Hardware, state_bytes: float) -> float:
    """The share of a CPU step's states still in the last-level cache from the step before, when the host's
    ranks update `state_bytes` of them in all: 1 when they are tiny, 0 once they reach the cache_bytes that
    calibrate() measured (presets have none: a model worth offloading fits in no CPU's cache), and linear in
    between, as the lines a step needs are evicted more often the less room is left."""
    if not hw.cpu_adam_cache_bytes or not hw.cpu_adam_cached_params_per_s:
        return 0.0
    return min(1.0, max(0.0, 1 - state_bytes / hw.cpu_adam_cache_bytes))


def moment_bytes_saved(moments: str) -> tuple[float, float]:
    """(traffic, held): bytes a parameter that m and v below fp32 take off the one-pass step's memory traffic
    (each read and written) and off the states it holds: bf16 8 and 4, int8 about 12 and 6 (scales counted)."""
    held = 8 - 2 * moment_bytes(QUANT_BLOCK, moments) / QUANT_BLOCK
    return 2 * held, held


def cpu_adam_seconds(
    hw: Hardware, params_on_host: float, calls: int, precision: str = "fp32", moments: str = "fp32"
) -> float:
    """One rank's CPU step: its start, its calls, and its parameters, at the cached speed for the share of
    their states still in the cache and at the rank's throughput from memory for the rest.

    With `moments` below fp32 the step from memory is taken to stay memory-bound and to speed up as its bytes
    shrink (28 -> 20 -> about 16 a parameter with fp16 in and out): a model, which `make bench`'s "states"
    section measures against."""
    form = ENGINE_FORM[precision]
    traffic_saved, held_saved = moment_bytes_saved(moments)
    # every rank's states on this host
    state_bytes = hw.gpus * params_on_host * (STATE_BYTES[form] - held_saved)
    share = cached_share(hw, state_bytes)
    per_param = (1 - share) / hw.cpu_adam_rank_params_per_s() * (1 - traffic_saved / FORM_BYTES[form])
    if share:
        per_param += share / hw.cpu_adam_cached_params_per_s
    return hw.cpu_adam_step_seconds + calls * hw.cpu_adam_call_seconds + params_on_host * per_param


def _model_states(
    params: int, dp: int, wl: Workload, stage: int, offload: str, ratio: float
) -> ModelStateBytes:
    if 0 < ratio < 1:  # the engine's partial offload: the device keeps the rest of the optimizer (partial.py)
        return estimate_partial_offload(
            params, stage=stage, world_size=dp, precision=wl.precision, host_fraction=ratio, moments=wl.moments
        )  # fmt: skip
    return estimate_model_states(
        params, stage=stage, world_size=dp, precision=wl.precision,
        offload_optimizer="cpu" if ratio > 0 else "none",
        offload_param="cpu" if offload == "optimizer+param" else "none",
        moments=wl.moments if ratio > 0 else "fp32",  # narrow moments are the host's (cpu_adam.states)
    )  # fmt: skip


def _collectives(stage: int, offloads: bool, micro: int, dp: int) -> float:
    """16-bit values a step per parameter of the GPU's piece, over the DP ranks: stage 0/1 all-reduce the
    gradients once; stage 2 or an offload reduce-scatters them every micro-batch and gathers the weights
    once; stage 3 gathers the weights for each micro-batch's forward and backward too."""
    ring = (dp - 1) / dp
    if stage == 3:
        return 3 * micro * ring
    return (micro + 1) * ring if stage == 2 or offloads else 2 * ring


def plan(
    hw: Hardware,
    wl: Workload,
    stage: int,
    offload: str = "none",
    ratio: float = 1.0,
    layout: Layout | None = None,
) -> Plan:
    """Memory per tier, whether it fits, and the step time of one stage x offload choice (and layout)."""
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}; got {offload!r}")
    if hw.gpus < 1:
        raise ValueError("the hardware needs at least 1 GPU (gpus=1 for a single device)")
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio is the share of the optimizer step on the host, in (0, 1]; got {ratio}")
    if ratio < 1 and offload == "optimizer+param":
        raise ValueError(
            "a partial offload updates some weights on the device: with offload_param keep ratio 1"
        )
    layout = layout or Layout()
    layout.check(hw, stage)
    ratio = 0.0 if offload == "none" else ratio
    low, dp, micro = LOW_BYTES[wl.precision], layout.dp(hw), layout.micro
    params = math.ceil(wl.params / (layout.tp * layout.pp))  # one GPU's piece of the model
    states = _model_states(params, dp, wl, stage, offload, ratio)
    shard = math.ceil(params / dp)
    on_host = ratio * shard  # elements of this rank's optimizer step run on the host
    # Staging: the host's 16-bit landing buffer for gradients and, unless the weights live on the host or are
    # the fp32 master itself, the one for the updated weights (implementation/offload.py).
    weight_staging = wl.precision != "fp32" and offload != "optimizer+param"
    staging = round(low * on_host * (1 + weight_staging))
    buffers = 0
    if stage >= 2 or ratio > 0:  # gradient buckets: one filling while the other is reduced
        buffers = 2 * min(wl.bucket_numel, params) * low * (2 if stage == 3 else 1)
    down = micro * low * on_host  # gradients, every micro-batch
    up = 2 * micro * low * shard if offload == "optimizer+param" else low * on_host  # weights
    flops = (8 if wl.recompute else 6) * params * wl.batch * wl.seq_len * micro
    compute = flops / (hw.gpu_tflops * 1e12 * hw.mfu)
    on_gpu = (1 - ratio) * (shard if stage >= 1 else params)
    collectives = _collectives(stage, ratio > 0, micro, dp) * low * params
    calls = math.ceil(ratio * wl.tensor_calls / layout.pp)  # the CPU Adam's: one per tensor it updates
    link = hw.link_gb_per_s * 1e9  # per direction
    time = StepTime(
        compute=compute,
        gpu_adam=on_gpu * ADAM_BYTES_PER_PARAM / (hw.gpu_memory_gb_per_s * 1e9),
        comm=collectives / (dp_link_gb_per_s(hw, layout) * 1e9) if dp > 1 else 0.0,
        pcie_down=down / link,
        pcie_up=up / link,
        cpu_adam=cpu_adam_seconds(hw, on_host, calls, wl.precision, wl.moments) if ratio > 0 else 0.0,
        model_parallel=model_parallel_seconds(hw, wl, layout, low),
        bubble=compute * bubble_share(layout),
    )
    activations = int(wl.activation_bytes() * activation_factor(layout))
    return Plan(
        stage, offload, ratio, states, activations, buffers, staging,
        device_bytes=states.device + activations + buffers,
        host_bytes=hw.gpus * (states.host + staging),
        device_usable=int(hw.gpu_memory * (1 - DEVICE_RESERVE)),
        host_usable=int(hw.host_memory * (1 - HOST_RESERVE)),
        pcie_bytes=round(down + up),
        time=time,
        layout=layout,
    )  # fmt: skip


def plan_all(hw: Hardware, wl: Workload) -> list[Plan]:
    """Every valid stage x offload choice, full offload. Stage 0 cannot offload; offload_param needs stage 3."""
    choices = [(0, "none"), (1, "none"), (1, "optimizer"), (2, "none"), (2, "optimizer")]
    choices += [(3, offload) for offload in OFFLOADS]
    return [plan(hw, wl, stage, offload) for stage, offload in choices]
