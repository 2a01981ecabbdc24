"""The hardware the performance model (perfmodel.py) runs on: presets, and calibrate() to measure this machine.

The CPU Adam is bound by memory bandwidth, not by arithmetic, and its figures are per host: the ranks on a
host share its memory channels. Two numbers describe it:

  cpu_adam_params_per_s         the whole host's throughput once its memory channels are saturated;
  cpu_adam_thread_params_per_s  what one thread reaches alone (a core can keep only so many cache misses in
                                flight, so one core cannot draw the whole host's bandwidth).

A rank whose CPU Adam runs T threads updates min(T x one thread, its share) parameters a second, its share
being the host's throughput / ranks when the host has one socket (NUMA below): threads add throughput until
the rank has its share of the memory bandwidth, and nothing after. The thread count to
recommend is that saturation point, never more than the cores per rank.

NUMA: a host has `sockets`, each with its own memory channels (host_memory_gb_per_s / sockets) and its
share of the host's throughput. The ranks are spread evenly over the sockets, each bound to its own socket's
cores and memory (what `deepspeed --bind_cores_to_rank` arranges), so a rank draws on its own socket only,
shared with the other ranks there. A rank alone on several sockets gets one socket's share too, unless its
threads and memory are spread over them (numa_spread: numactl --interleave=all); then half its traffic (two
sockets) crosses the inter-socket link, which caps it at 4 x that link's bandwidth per direction, at the same
60% efficiency as the memory estimate. calibrate() measures what one process reaches and calls it one socket.

Both are for states that come from memory, as a model worth offloading has them. Small states stay in the
last-level cache from one step to the next and update faster: calibrate() also measures that speed
(cpu_adam_cached_params_per_s) and how many bytes of states the cache keeps (cpu_adam_cache_bytes), and the
performance model mixes the two speeds by the share of a step's states that is still cached.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

from ..units import parse_bytes
from . import bandwidth as probe
from .cpu_adam import default_threads
from .cpuinfo import cpu_caches

ADAM_BYTES_PER_PARAM = 28  # one fused pass: read w, g, m, v (16 bytes), write w, m, v (12 bytes)
GiB = 2**30


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
    host_memory_gb_per_s: float  # DRAM traffic, read + write, with every core at work
    cpu_cores: int
    cpu_adam_params_per_s: float  # per host: all its ranks' CPU Adams together, memory saturated
    cpu_adam_thread_params_per_s: float  # one CPU Adam thread alone
    cpu_adam_threads: int  # threads each rank's CPU Adam runs with
    cpu_adam_call_seconds: float = 30e-6  # Python and argument checks of one call (one per tensor)
    cpu_adam_step_seconds: float = 0.0  # once a step: first touches of memory whose caches were emptied
    cpu_adam_cached_params_per_s: float | None = None  # one rank, its states still in the cache (calibrate)
    cpu_adam_cache_bytes: int = 0  # states (all ranks') the cache keeps between steps; 0: none or unknown
    pageable_link_gb_per_s: float | None = None  # measured by calibrate() on a CUDA host
    link_kind: str = "PCIe"  # what link_gb_per_s is: "host memcpy" for the emulated device
    mfu: float = 0.4  # model FLOPs utilization: the share of peak a training step reaches (30-50% is usual)
    sockets: int = 1  # NUMA nodes, each with host_memory_gb_per_s / sockets of the memory bandwidth
    socket_link_gb_per_s: float | None = None  # between two sockets, per direction (QPI/UPI/xGMI), nominal
    numa_spread: bool = False  # a rank alone on several sockets spreads its threads and memory over them
    nodes: int = 1  # hosts like this one in the job; the layouts (parallel.py) span them
    inter_node_gb_per_s: float | None = None  # between hosts, per GPU and direction (InfiniBand/RoCE)
    notes: str = ""

    @property
    def ranks_per_socket(self) -> int:
        return max(1, math.ceil(self.gpus / self.sockets))

    def sockets_per_rank(self) -> int:
        """1, unless a rank is alone on several sockets and spreads over them (numa_spread)."""
        return self.sockets // self.gpus if self.numa_spread and self.gpus < self.sockets else 1

    def cpu_adam_rank_share(self) -> float:
        """One rank's share of the memory-bound throughput: its socket's, divided among the ranks there;
        a spread rank's sockets together, at most what the inter-socket link lets cross (module docstring)."""
        socket = self.cpu_adam_params_per_s / self.sockets
        spanned = self.sockets_per_rank()
        if spanned == 1:
            return socket / self.ranks_per_socket
        share = spanned * socket
        if self.socket_link_gb_per_s:  # interleaved: (k-1)/k of the traffic crosses, over k directions
            crossing = _cpu_adam_rate(self.socket_link_gb_per_s) * spanned * spanned / (spanned - 1)
            share = min(share, crossing)
        return share

    def cpu_adam_rank_params_per_s(self, threads: int | None = None) -> float:
        """One rank's CPU Adam throughput: its threads' own speed, at most its share of its socket's."""
        threads = threads or self.cpu_adam_threads
        return min(threads * self.cpu_adam_thread_params_per_s, self.cpu_adam_rank_share())

    @property
    def cores_per_rank(self) -> int:
        return max(1, self.cpu_cores // self.gpus)

    def cpu_adam_saturating_threads(self) -> int:
        """The fewest threads a rank needs for its share of its socket's throughput; more add nothing.

        At most the cores per rank (where even they fall short, the rank gets all of them).
        """
        share = self.cpu_adam_rank_share()
        needed = math.ceil(share / self.cpu_adam_thread_params_per_s - 1e-9)
        return max(1, min(self.cores_per_rank, needed))


def _cpu_adam_rate(dram_gb_per_s: float, efficiency: float = 0.6) -> float:
    """Parameters/s of a memory-bound one-pass Adam: a share of peak DRAM bandwidth over 28 bytes a parameter.

    60% of peak is about what STREAM reaches on two-socket servers; `zo plan --calibrate` measures instead.
    """
    return efficiency * dram_gb_per_s * 1e9 / ADAM_BYTES_PER_PARAM


# Figures from NVIDIA's data sheets (DGX-1 V100, DGX A100 640GB, DGX H200) and the CPUs' memory channels.
# Links are the usual measured bandwidths, below the nominal 16 / 32 / 64 GB/s of PCIe 3 / 4 / 5 x16;
# NVLink is about 80% of its nominal bandwidth per direction (150 / 300 / 450 GB/s), as NCCL reaches it.
# One thread's rate is one core's DRAM bandwidth (about what single-thread STREAM reaches on these CPUs:
# 10 GB/s Broadwell, 20 GB/s Rome, 15 GB/s Sapphire Rapids) over 28 bytes a parameter.
# Two sockets each; the inter-socket links are nominal per direction: 2 QPI at 9.6 GT/s (2 x 19.2 GB/s),
# 4 xGMI-2 x16 at 18 GT/s (4 x 36), 4 UPI 2.0 at 16 GT/s (4 x 32). Between hosts: the compute NICs per GPU,
# at about 80% of nominal: DGX-1 4 x 100 Gb/s EDR for 8 GPUs, DGX A100 one 200 Gb/s HDR, DGX H200 one
# 400 Gb/s NDR per GPU. The presets are one host (nodes=1); the layouts table also tries two.
PRESETS = {
    "v100-32g": Hardware(
        "v100-32g", gpus=8, gpu_memory=32 * GiB, gpu_tflops=125, gpu_memory_gb_per_s=900,
        gpu_link_gb_per_s=120, link_gb_per_s=12, host_memory=512 * GiB,
        host_memory_gb_per_s=153.6,  # 2 x Xeon E5-2698 v4, 4 channels DDR4-2400 each
        cpu_cores=40, cpu_adam_params_per_s=_cpu_adam_rate(153.6),
        cpu_adam_thread_params_per_s=_cpu_adam_rate(10, 1.0), cpu_adam_threads=5,
        sockets=2, socket_link_gb_per_s=38.4, inter_node_gb_per_s=5,
        notes="DGX-1: 8 x V100-SXM2-32GB, PCIe 3",
    ),
    "a100-80g": Hardware(
        "a100-80g", gpus=8, gpu_memory=80 * GiB, gpu_tflops=312, gpu_memory_gb_per_s=2039,
        gpu_link_gb_per_s=240, link_gb_per_s=25, host_memory=2048 * GiB,
        host_memory_gb_per_s=409.6,  # 2 x EPYC 7742, 8 channels DDR4-3200 each
        cpu_cores=128, cpu_adam_params_per_s=_cpu_adam_rate(409.6),
        cpu_adam_thread_params_per_s=_cpu_adam_rate(20, 1.0), cpu_adam_threads=16,
        sockets=2, socket_link_gb_per_s=144, inter_node_gb_per_s=20,
        notes="DGX A100: 8 x A100-SXM4-80GB, PCIe 4",
    ),
    "h200": Hardware(
        "h200", gpus=8, gpu_memory=141 * 10**9, gpu_tflops=989, gpu_memory_gb_per_s=4800,
        gpu_link_gb_per_s=360, link_gb_per_s=50, host_memory=2048 * GiB,
        host_memory_gb_per_s=614.4,  # 2 x Xeon Platinum 8480C, 8 channels DDR5-4800 each
        cpu_cores=112, cpu_adam_params_per_s=_cpu_adam_rate(614.4),
        cpu_adam_thread_params_per_s=_cpu_adam_rate(15, 1.0), cpu_adam_threads=14,
        sockets=2, socket_link_gb_per_s=128, inter_node_gb_per_s=40,
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


def sweep_threads(threads: int) -> list[int]:
    """The thread counts calibrate() measures: 1, 2, 4, ... and `threads` itself."""
    return sorted({1, threads, *(2**k for k in range(1, threads.bit_length()) if 2**k < threads)})


def calibrate(
    base: Hardware | None = None,
    *,
    threads: int | None = None,
    precision: str = "fp16",
    numel: int = 4_000_000,
    repeats: int = 5,
) -> Hardware:
    """Measure this machine with bandwidth.py and return its Hardware.

    Always the CPU Adam, in the form the engine runs for `precision`, at 1, 2, 4, ... up to `threads` threads
    (default: as many as the engine uses), which is what each rank then runs with: one thread's throughput,
    the best of the sweep as the host's, and the call and step costs at `threads`; at `threads` too, its speed
    on states that stay in the last-level cache and how many bytes of them the cache keeps
    (bandwidth.cache_profile); and the host's memory bandwidth (the memory floor's traffic, the best of the
    sweep). With `base` (a preset), that is all it replaces, plus the measured PCIe link (pinned and pageable)
    where CUDA is present: the preset keeps its capacities (GPUs, GPU and host memory, cores) and its GPUs'
    speeds. Without `base` it describes this whole machine ("this-cpu"): its memory and cores too, and with
    CUDA its GPUs; without CUDA the device is the emulated one: its memory is ZO_DEVICE_MEMORY (else all RAM),
    its "link" is a host memory copy, its "HBM" is host memory, and it computes in fp32 on the CPU. A
    GPU-to-GPU link is never measured (without `base`, assumed no faster than the device-host link).
    """
    threads = threads or default_threads()
    form = probe.ENGINE_FORM[precision]
    profiles = [
        probe.cpu_adam_profile(threads=t, form=form, numel=numel, repeats=repeats)
        for t in sweep_threads(threads)
    ]
    own = profiles[-1]  # the rank's own thread count
    last_level = cpu_caches().last_level
    # States that stay in the cache: at the rank's threads, with the C kernel, where the OS gives the cache's size.
    cache = probe.cache_profile(own, last_level, repeats) if own.impl == "C SIMD" and last_level else None
    floors = [p.floor_gb_per_s for p in profiles if p.floor_gb_per_s]
    # Without the C kernel there is no floor to time: a multi-threaded fp32 copy reads and writes each byte.
    memory = (
        max(floors) if floors else 2 * probe.host_copy_bandwidth(threads=threads, repeats=repeats).gb_per_s
    )
    measured = dict(
        host_memory_gb_per_s=memory,
        cpu_adam_params_per_s=max(p.params_per_s for p in profiles),
        cpu_adam_thread_params_per_s=profiles[0].params_per_s,
        cpu_adam_threads=threads,
        cpu_adam_call_seconds=own.call_seconds,
        cpu_adam_step_seconds=own.step_seconds,
        cpu_adam_cached_params_per_s=cache.cached_params_per_s if cache else None,
        cpu_adam_cache_bytes=cache.cache_bytes if cache else 0,
        sockets=1,  # what one process reached: its threads and memory wherever the OS put them
        numa_spread=False,
    )
    if torch.cuda.is_available():
        link = probe.device_link_bandwidth(repeats=repeats)
        measured.update(link_gb_per_s=link.pinned, pageable_link_gb_per_s=link.pageable, link_kind="PCIe")
    sweep = ", ".join(f"{p.threads}: {p.params_per_s / 1e6:.0f}" for p in profiles)
    notes = f"calibrated: {own.impl} Adam, {own.form} form, Mparam/s by threads {sweep}"
    notes += f"; memory {memory:.3g} GB/s"
    if cache:
        notes += (f"; cached {cache.cached_params_per_s / 1e6:.0f} Mparam/s, the cache keeps "
                  f"{cache.cache_bytes / 2**20:.0f} MiB of states ({cpu_caches().describe()})")  # fmt: skip
    notes += f"; {own.note}" if own.note else ""
    if base is not None:
        return replace(base, name=f"{base.name}+calibrated", notes=notes, **measured)
    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    measured.update(host_memory=host_memory, cpu_cores=cores)
    if torch.cuda.is_available():
        hbm = probe.host_copy_bandwidth(repeats=repeats, device="cuda")
        measured.update(
            gpus=torch.cuda.device_count(),
            gpu_memory_gb_per_s=2 * hbm.gb_per_s,
            gpu_memory=torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory,
            gpu_tflops=probe.matmul_tflops(size=4096, repeats=repeats),
        )
    else:
        budget = os.environ.get("ZO_DEVICE_MEMORY")
        measured.update(
            gpus=1,
            gpu_memory=parse_bytes(budget) if budget else host_memory,
            link_gb_per_s=probe.host_copy_bandwidth(threads=threads, repeats=repeats).gb_per_s,
            link_kind="host memcpy",
            gpu_memory_gb_per_s=memory,
            gpu_tflops=probe.matmul_tflops(size=512, repeats=repeats),
        )
    return Hardware("this-cpu", gpu_link_gb_per_s=measured["link_gb_per_s"], notes=notes, **measured)
