"""A performance model of ZeRO(-Offload) training (the advisor built on it is advisor.py).

For a model of P parameters on a host with N GPUs (one rank each, shard = P / N), one training step costs:

  compute    6 * P * tokens FLOPs (forward 2, backward 4 per parameter and token; 8 with activation
             recomputation, which runs forward twice), at gpu_tflops * mfu. Attention's own FLOPs are left out.
  GPU Adam   the part of the optimizer step on the device: 28 bytes of HBM traffic a parameter
             (read weight, gradient, m, v; write weight, m, v, all fp32), at the HBM bandwidth.
  comm       GPU-to-GPU (NVLink): reduce-scatter + all-gather, 2 (N-1)/N * P 16-bit values a step (as one
             all-reduce); stage 3 gathers the weights twice (forward and backward): 3 (N-1)/N.
  PCIe       offload_optimizer: the rank's fp16 gradients down and fp16 weights up, 2 + 2 bytes a parameter
             of its shard; offload_param: the weights go up for every gather (2 + 2) and never come back.
  CPU Adam   step_seconds + calls * call_seconds + params_on_host / params_per_s, the host's throughput
             shared by its ranks (a start-up cost once a step, one per tensor, then the elements).

`serial` adds them up (this engine up to module 4). `overlapped` is the busiest resource alone: every copy,
collective and, with module 5's delayed parameter update, the CPU step hidden behind compute. Real steps
fall between the two. Memory per tier comes from basics.estimate_model_states, plus activations, working
buffers and the host's fp16 staging buffers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

from ..basics.memory import ModelStateBytes, estimate_model_states
from ..units import parse_bytes
from . import bandwidth as probe
from .partial import estimate_partial_offload

ADAM_BYTES_PER_PARAM = 28  # one fused pass: read w, g, m, v (16 bytes), write w, m, v (12 bytes)
LOW_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
OFFLOADS = ("none", "optimizer", "optimizer+param")
DEVICE_RESERVE = 0.08  # CUDA context, allocator fragmentation and communication buffers
HOST_RESERVE = 0.10  # the OS, the data loader and the Python processes themselves


@dataclass(frozen=True)
class Hardware:
    """One host: its GPUs (one rank each), its CPU and memory, and the links between them."""

    name: str
    gpus: int
    gpu_memory: int  # bytes per GPU
    gpu_tflops: float  # peak dense 16-bit TFLOP/s per GPU (fp32 for the emulated device)
    gpu_memory_gb_per_s: float  # HBM bandwidth: the device's Adam is bound by it
    gpu_link_gb_per_s: float  # GPU-to-GPU bandwidth per GPU and direction (NVLink)
    link_gb_per_s: float  # device<->host per GPU and direction, from pinned memory (PCIe)
    host_memory: int  # bytes
    host_memory_gb_per_s: float  # DRAM traffic, read + write
    cpu_cores: int
    cpu_adam_params_per_s: float  # the whole host's CPU Adam, all ranks together
    cpu_adam_threads: int  # threads each rank's CPU Adam runs with
    cpu_adam_call_seconds: float = 30e-6  # Python and argument checks of one call (one per tensor)
    cpu_adam_step_seconds: float = 0.0  # once a step: first touches of memory whose caches were emptied
    pageable_link_gb_per_s: float | None = None  # measured by calibrate() on a CUDA host
    mfu: float = 0.4  # model FLOPs utilization: the share of peak a training step reaches (30-50% is usual)
    notes: str = ""


def _cpu_adam_rate(dram_gb_per_s: float, efficiency: float = 0.6) -> float:
    """Parameters/s of a memory-bound one-pass Adam: a share of peak DRAM bandwidth over 28 bytes a parameter.

    60% of peak is about what STREAM reaches on two-socket servers; `zo plan --calibrate` measures instead.
    """
    return efficiency * dram_gb_per_s * 1e9 / ADAM_BYTES_PER_PARAM


GiB = 2**30
# Figures from NVIDIA's data sheets (DGX-1 V100, DGX A100 640GB, DGX H200) and the CPUs' memory channels.
# Links are the usual measured bandwidths, below the nominal 16 / 32 / 64 GB/s of PCIe 3 / 4 / 5 x16;
# NVLink is about 80% of its nominal bandwidth per direction (150 / 300 / 450 GB/s), as NCCL reaches it.
PRESETS = {
    "v100-32g": Hardware(
        "v100-32g", gpus=8, gpu_memory=32 * GiB, gpu_tflops=125, gpu_memory_gb_per_s=900,
        gpu_link_gb_per_s=120, link_gb_per_s=12, host_memory=512 * GiB,
        host_memory_gb_per_s=153.6,  # 2 x Xeon E5-2698 v4, 4 channels DDR4-2400 each
        cpu_cores=40, cpu_adam_params_per_s=_cpu_adam_rate(153.6), cpu_adam_threads=5,
        notes="DGX-1: 8 x V100-SXM2-32GB, PCIe 3",
    ),
    "a100-80g": Hardware(
        "a100-80g", gpus=8, gpu_memory=80 * GiB, gpu_tflops=312, gpu_memory_gb_per_s=2039,
        gpu_link_gb_per_s=240, link_gb_per_s=25, host_memory=2048 * GiB,
        host_memory_gb_per_s=409.6,  # 2 x EPYC 7742, 8 channels DDR4-3200 each
        cpu_cores=128, cpu_adam_params_per_s=_cpu_adam_rate(409.6), cpu_adam_threads=16,
        notes="DGX A100: 8 x A100-SXM4-80GB, PCIe 4",
    ),
    "h200": Hardware(
        "h200", gpus=8, gpu_memory=141 * 10**9, gpu_tflops=989, gpu_memory_gb_per_s=4800,
        gpu_link_gb_per_s=360, link_gb_per_s=50, host_memory=2048 * GiB,
        host_memory_gb_per_s=614.4,  # 2 x Xeon Platinum 8480C, 8 channels DDR5-4800 each
        cpu_cores=112, cpu_adam_params_per_s=_cpu_adam_rate(614.4), cpu_adam_threads=14,
        notes="DGX H200: 8 x H200 141GB, PCIe 5",
    ),
}  # fmt: skip
PRESET_NAMES = (*PRESETS, "this-cpu")


def hardware_preset(name: str) -> Hardware:
    """A preset by name; "this-cpu" measures this machine (calibrate()) and takes a few seconds."""
    if name == "this-cpu":
        return calibrate()
    if name not in PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")
    return PRESETS[name]


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

    def __post_init__(self):
        if self.params < 1 or self.batch < 1 or self.seq_len < 1:
            raise ValueError("params, batch and seq_len must each be at least 1")
        if self.precision not in LOW_BYTES:
            raise ValueError(f"precision must be one of {', '.join(LOW_BYTES)}; got {self.precision!r}")

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
    """Seconds a step keeps each resource busy."""

    compute: float
    gpu_adam: float
    comm: float
    pcie: float
    cpu_adam: float

    @property
    def serial(self) -> float:
        return self.compute + self.gpu_adam + self.comm + self.pcie + self.cpu_adam

    def busy(self) -> dict[str, float]:
        gpu = self.compute + self.gpu_adam
        return {"GPU": gpu, "GPU-GPU": self.comm, "PCIe": self.pcie, "CPU Adam": self.cpu_adam}

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
    host_bytes: int  # the whole host: every rank's states and staging
    device_usable: int
    host_usable: int
    pcie_bytes: int  # per rank and step, both directions
    time: StepTime

    @property
    def fits(self) -> bool:
        return self.device_bytes <= self.device_usable and self.host_bytes <= self.host_usable

    @property
    def label(self) -> str:
        text = f"stage {self.stage}" + ("" if self.offload == "none" else f" + {self.offload} offload")
        return text + (f" (ratio {self.ratio:g})" if 0 < self.ratio < 1 else "")


def cpu_adam_seconds(hw: Hardware, params_on_host: float, calls: int) -> float:
    """One rank's CPU step: its start, its calls, and its parameters at its share of the host's throughput."""
    share = params_on_host * hw.gpus / hw.cpu_adam_params_per_s
    return hw.cpu_adam_step_seconds + calls * hw.cpu_adam_call_seconds + share


def _model_states(hw: Hardware, wl: Workload, stage: int, offload: str, ratio: float) -> ModelStateBytes:
    if 0 < ratio < 1:  # the engine's partial offload: the device keeps the rest of the optimizer (partial.py)
        return estimate_partial_offload(
            wl.params, stage=stage, world_size=hw.gpus, precision=wl.precision, host_fraction=ratio
        )
    return estimate_model_states(
        wl.params, stage=stage, world_size=hw.gpus, precision=wl.precision,
        offload_optimizer="cpu" if ratio > 0 else "none",
        offload_param="cpu" if offload == "optimizer+param" else "none",
    )  # fmt: skip


def plan(hw: Hardware, wl: Workload, stage: int, offload: str = "none", ratio: float = 1.0) -> Plan:
    """Memory per tier, whether it fits, and the step time of one stage x offload choice."""
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
    ratio = 0.0 if offload == "none" else ratio
    states = _model_states(hw, wl, stage, offload, ratio)
    low, n = LOW_BYTES[wl.precision], hw.gpus
    shard = math.ceil(wl.params / n)
    on_host = ratio * shard  # elements of this rank's optimizer step run on the host
    # Staging: the host's 16-bit landing buffer for gradients and, unless the weights live on the host or are
    # the fp32 master itself, the one for the updated weights (implementation/offload.py).
    weight_staging = wl.precision != "fp32" and offload != "optimizer+param"
    staging = round(low * on_host * (1 + weight_staging))
    buffers = 0
    if stage >= 2 or ratio > 0:  # gradient buckets: one filling while the other is reduced
        buffers = 2 * min(wl.bucket_numel, wl.params) * low * (2 if stage == 3 else 1)
    down = low * on_host  # gradients
    up = 2 * low * shard if offload == "optimizer+param" else low * on_host  # weights
    flops = (8 if wl.recompute else 6) * wl.params * wl.batch * wl.seq_len
    on_gpu = (1 - ratio) * (shard if stage >= 1 else wl.params)
    collectives = (3 if stage == 3 else 2) * (n - 1) / n * low * wl.params
    time = StepTime(
        compute=flops / (hw.gpu_tflops * 1e12 * hw.mfu),
        gpu_adam=on_gpu * ADAM_BYTES_PER_PARAM / (hw.gpu_memory_gb_per_s * 1e9),
        comm=collectives / (hw.gpu_link_gb_per_s * 1e9) if n > 1 else 0.0,
        pcie=(down + up) / (hw.link_gb_per_s * 1e9),
        cpu_adam=cpu_adam_seconds(hw, on_host, math.ceil(ratio * wl.tensor_calls)) if ratio > 0 else 0.0,
    )
    activations = wl.activation_bytes()
    return Plan(
        stage, offload, ratio, states, activations, buffers, staging,
        device_bytes=states.device + activations + buffers,
        host_bytes=n * (states.host + staging),
        device_usable=int(hw.gpu_memory * (1 - DEVICE_RESERVE)),
        host_usable=int(hw.host_memory * (1 - HOST_RESERVE)),
        pcie_bytes=round(down + up),
        time=time,
    )  # fmt: skip


def plan_all(hw: Hardware, wl: Workload) -> list[Plan]:
    """Every valid stage x offload choice, full offload. Stage 0 cannot offload; offload_param needs stage 3."""
    choices = [(0, "none"), (1, "none"), (1, "optimizer"), (2, "none"), (2, "optimizer")]
    choices += [(3, offload) for offload in OFFLOADS]
    return [plan(hw, wl, stage, offload) for stage, offload in choices]


# -- calibration: this machine's figures, measured -----------------------------------------------------------
def calibrate(
    base: Hardware | None = None,
    *,
    threads: int | None = None,
    precision: str = "fp16",
    numel: int = 4_000_000,
    repeats: int = 5,
) -> Hardware:
    """Measure this machine with bandwidth.py and return its Hardware.

    The host side always: the CPU Adam's throughput and call cost with `threads` (default: as many as the
    engine uses) in the form the engine runs for `precision`, host memory and its bandwidth. With CUDA, the
    device side too: link bandwidth pinned and pageable, matmul speed, GPU memory and its bandwidth. Without
    CUDA and without `base`, the device is the emulated one: its memory is ZO_DEVICE_MEMORY (else all RAM),
    its "transfers" and its "HBM" are host memory copies, and it computes in fp32 on the CPU. `base` gives
    what is not measured; a GPU-to-GPU link never is (without `base`, assumed no faster than PCIe).
    """
    adam = probe.cpu_adam_profile(
        threads=threads, form=probe.ENGINE_FORM[precision], numel=numel, repeats=repeats
    )
    copy = probe.host_copy_bandwidth(repeats=repeats)
    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    measured = dict(
        host_memory=host_memory,
        host_memory_gb_per_s=2 * copy.gb_per_s,
        cpu_cores=cores,
        cpu_adam_params_per_s=adam.params_per_s,
        cpu_adam_threads=adam.threads,
        cpu_adam_call_seconds=adam.call_seconds,
        cpu_adam_step_seconds=adam.step_seconds,
    )
    if torch.cuda.is_available():
        link = probe.device_link_bandwidth(repeats=repeats)
        hbm = probe.host_copy_bandwidth(repeats=repeats, device="cuda")
        measured.update(
            gpus=torch.cuda.device_count(),
            link_gb_per_s=link.pinned,
            pageable_link_gb_per_s=link.pageable,
            gpu_memory_gb_per_s=2 * hbm.gb_per_s,
            gpu_memory=torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory,
            gpu_tflops=probe.matmul_tflops(size=4096, repeats=repeats),
        )
    elif base is None:
        budget = os.environ.get("ZO_DEVICE_MEMORY")
        measured.update(
            gpus=1,
            gpu_memory=parse_bytes(budget) if budget else host_memory,
            link_gb_per_s=copy.gb_per_s,
            gpu_memory_gb_per_s=2 * copy.gb_per_s,
            gpu_tflops=probe.matmul_tflops(size=512, repeats=repeats),
        )
    notes = f"calibrated: {adam.impl} Adam, {adam.form} form, {adam.threads} thread(s)"
    notes += f"; {adam.note}" if adam.note else ""
    if base is None:
        return Hardware("this-cpu", gpu_link_gb_per_s=measured["link_gb_per_s"], notes=notes, **measured)
    return replace(base, name=f"{base.name}+calibrated", notes=notes, **measured)
