"""Probes: measure what the performance model (perfmodel.py) needs to know about this machine.

Four numbers decide how fast ZeRO-Offload trains ("GPU computes, CPU stores, PCIe moves"):

  host_copy_bandwidth()    how fast host memory copies, on several threads (one thread cannot saturate it);
  device_link_bandwidth()  how fast the device<->host link (PCIe) moves bytes, from pinned and from pageable
                           memory (CUDA only);
  cpu_adam_profile()       how many parameters a second our C Adam updates, what each call costs, and the
                           memory floor at the same threads (its bytes, no arithmetic: the CPU Adam is
                           bound by memory, and the floor bounds its throughput and measures the bandwidth);
  cache_profile()          how much faster it runs when its states stay in the last-level cache, and how
                           many bytes of states the cache keeps from one step to the next;
  matmul_tflops()          how fast the device multiplies matrices (the compute of forward and backward).

Each probe returns plain numbers (a small dataclass) and takes a second or less at its default size, less at
the small sizes tests use. Every timing is the median of several repeats: one slow repeat (another process,
a page fault) does not move a median.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .build import CompilerNotFound, build
from .cpu_adam import CPUAdam, default_threads, memory_floor, one_pass_update
from .cpuinfo import cpu_caches

# Gradient dtype in, weight dtype out (None: none written) of the CPU Adam forms the engine runs.
ADAM_FORMS = {
    "fp32": (torch.float32, None),  # fp32 training: the master weights are the weights
    "fp16": (torch.float16, torch.float16),  # the one pass: fp16 gradients in, fp16 weights out
    "mixed": (torch.float32, torch.float16),  # the offloaded fp16 step: fp32 gradient partition in, fp16 out
}
# The engine's offloaded step for each training precision (the host keeps its gradient partition in fp32).
ENGINE_FORM = {"fp32": "fp32", "fp16": "mixed", "bf16": "mixed"}
# Bytes of memory traffic a parameter of each form: w, g, m, v read, w, m, v written, and the 16-bit output.
FORM_BYTES = {"fp32": 28, "fp16": 28, "mixed": 30}
FLOOR_BYTES = 28  # what tuning.cpu_adam.memory_floor moves a parameter (fp32 gradients, or 16-bit in and out)
# Bytes of the states one parameter's update touches (w, g, m, v and the 16-bit output): what must stay in the
# cache from one step to the next for the step to run at the cache's speed.
STATE_BYTES = {"fp32": 16, "fp16": 16, "mixed": 18}
# The cold passes of cpu_adam_profile measure the speed of states that come from memory, so before each one we
# read a buffer twice the last-level cache (at least 128 MiB where the OS does not say; at most 1 GiB): a fixed
# 128 MiB left most of a 64 MiB probe in a 480 MiB cache, and the "memory" speed was the cache's. Read, not
# write: written lines would still be waiting in the cache, and writing them back would slow the timed update.
_LAST_LEVEL = cpu_caches().last_level
FLUSH_BYTES = min(max(128 * 2**20, 2 * (_LAST_LEVEL or 0)), 2**30)


def median_seconds(
    fn: Callable[[], object], repeats: int = 5, *, warmup: int = 1, before: Callable[[], object] | None = None
) -> float:
    """Median wall time of `fn()` over `repeats` runs; `before()` runs untimed ahead of each one."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@functools.cache  # filling FLUSH_BYTES takes longer than a small probe: calibrate() runs several probes
def _cache_flusher() -> Callable[[], object]:
    buffer = torch.ones(FLUSH_BYTES // 4)  # written: its pages are real ones, not the shared zero page
    return lambda: buffer.sum()


@dataclass(frozen=True)
class Bandwidth:
    """`nbytes` copied in `seconds` (median). A copy reads and writes each byte: memory traffic is twice this."""

    nbytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9


def host_copy_bandwidth(
    nbytes: int = 64 * 2**20, repeats: int = 5, device="cpu", threads: int | None = None
) -> Bandwidth:
    """Host memory: one fp32 torch copy between two buffers of `nbytes` (use more than the last-level cache),
    on `threads` of torch's threads (default: as many as the engine's CPU Adam), as the emulated device copies.

    One thread cannot draw a host's whole memory bandwidth; calibrate() uses the memory floor of the C kernel
    where it has one. With a CUDA `device` the same copy measures the GPU's own memory (HBM) instead.
    """
    device = torch.device(device)
    source = torch.ones(nbytes // 4, device=device)
    target = torch.empty(nbytes // 4, device=device)

    def copy():
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    previous = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(threads or default_threads())
    try:
        return Bandwidth(source.nbytes, median_seconds(copy, repeats))
    finally:
        torch.set_num_threads(previous)


@dataclass(frozen=True)
class LinkBandwidth:
    """Device<->host copies in GB/s, from page-locked (pinned) and from ordinary (pageable) host memory."""

    h2d_pinned: float
    h2d_pageable: float
    d2h_pinned: float
    d2h_pageable: float

    @property
    def pinned(self) -> float:
        """The slower direction: ZeRO-Offload sends as many bytes down (gradients) as up (weights)."""
        return min(self.h2d_pinned, self.d2h_pinned)

    @property
    def pageable(self) -> float:
        return min(self.h2d_pageable, self.d2h_pageable)

    @property
    def pinned_speedup(self) -> float:
        return self.pinned / self.pageable


def device_link_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 5, device=None) -> LinkBandwidth:
    """PCIe (or NVLink-C2C) bandwidth of a CUDA device in each direction, pinned against pageable.

    A pageable copy goes through a pinned bounce buffer the driver keeps, one chunk at a time, and blocks the
    host; a pinned copy is one DMA transfer. Raises RuntimeError where there is no CUDA device.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "device_link_bandwidth needs a CUDA device and torch sees none; on the emulated device a "
            "'transfer' is a host memory copy: use host_copy_bandwidth()"
        )
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    results = {}
    for pin in (True, False):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        kind = "pinned" if pin else "pageable"
        for name, dst, src in (("h2d", on_device, host), ("d2h", host, on_device)):

            def copy(dst=dst, src=src, pin=pin):
                dst.copy_(src, non_blocking=pin)
                torch.cuda.synchronize(device)  # count the whole transfer, not only its launch

            results[f"{name}_{kind}"] = Bandwidth(nbytes, median_seconds(copy, repeats)).gb_per_s
    return LinkBandwidth(**results)


@dataclass(frozen=True)
class AdamProfile:
    """The CPU Adam's cost on this machine: seconds = step + calls * call + params / params_per_s."""

    impl: str  # "C SIMD" or "torch fused" (where no C compiler exists)
    form: str  # a key of ADAM_FORMS
    threads: int
    params_per_s: float
    call_seconds: float  # Python, argument checks, thread start-up: paid once per tensor updated
    step_seconds: float  # paid once per step: the first touches of memory whose caches were emptied
    note: str = ""
    floor_gb_per_s: float | None = None  # the memory floor's DRAM traffic at these threads (C kernel only)

    def seconds(self, params: float, calls: int = 1) -> float:
        return self.step_seconds + calls * self.call_seconds + params / self.params_per_s


def _adam_buffers(total: int, form: str) -> list[torch.Tensor]:
    """Flat weight, gradient, m, v (and output) buffers of `total` elements, at uneven distances in one allocation.

    Equal buffers allocated one after another sit at one fixed, round distance; the streams of an update then
    fall into the same cache sets and DRAM banks and run slower (by about 15% on the course's machine) than the
    engine's buffers, which lie wherever the allocator put them among others.
    """
    grad_dtype, out_dtype = ADAM_FORMS[form]
    dtypes = [torch.float32, grad_dtype, torch.float32, torch.float32] + ([out_dtype] if out_dtype else [])
    gap = 7 * 4096 + 192  # bytes: neither a whole page nor a power of two
    sizes = [total * torch.empty((), dtype=dtype).element_size() for dtype in dtypes]
    arena = torch.empty(sum(sizes) + gap * len(sizes) + 64, dtype=torch.uint8)
    start, buffers = (-arena.data_ptr()) % 64, []
    for size, dtype in zip(sizes, dtypes, strict=True):
        buffers.append(arena[start : start + size].view(dtype).zero_())
        start += size + gap
    buffers[1].fill_(0.01)  # the values do not change the speed of a pass bound by memory
    return buffers


def _c_adam_pass(flat: list[torch.Tensor], pieces: int, numel: int, threads: int) -> Callable[[], None]:
    """One Adam step over `pieces` tensors of `numel` elements each: views of flat buffers, as the engine's.

    Each tensor goes through the call the engine makes for each of its units (cpu_adam.one_pass_update): the
    optimizer's bookkeeping around the kernel, and the squared gradient norm summed in the same pass, which
    the engine does whenever it does not clip (it reports the norm). Timing the bare kernel instead left out
    10-20% of the engine's step on the course's machine: the norm, and the bookkeeping of the many small units.
    """
    views = [[buffer[i * numel : (i + 1) * numel] for buffer in flat] for i in range(pieces)]
    optimizer = CPUAdam([view[0] for view in views], lr=1e-3, adamw=False, threads=threads)
    for param, _, exp_avg, exp_avg_sq, *_ in views:
        optimizer.state[param] = {"step": torch.zeros(()), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}

    def run():
        for param, grad, _, _, *out in views:
            one_pass_update(optimizer, param, grad, out[0] if out else None, 1.0, norm=True)

    return run


def _floor_pass(flat: list[torch.Tensor], numel: int, threads: int) -> Callable[[], None]:
    """The memory floor over the first `numel` elements of the flat buffers: their bytes, no arithmetic."""
    param, grad, exp_avg, exp_avg_sq, *out = (buffer[:numel] for buffer in flat)
    # The mixed form's fp32 gradients with a 16-bit output have no floor of their own: leave the output out.
    out = out[0] if out and grad.dtype != torch.float32 else None
    return lambda: memory_floor(param, grad, exp_avg, exp_avg_sq, out=out, threads=threads)


def _torch_adam_pass(pieces: int, numel: int) -> Callable[[], None]:
    params = [torch.zeros(numel, requires_grad=True) for _ in range(pieces)]
    for param in params:
        param.grad = torch.full((numel,), 0.01)
    return torch.optim.Adam(params, lr=1e-3, fused=True).step  # on torch's threads: see cpu_adam_profile


def fit_adam_cost(
    numel: int, few: float, many: float, double: float, floor: float | None = None, form: str = "fp32"
) -> tuple[float, float, float]:
    """(params_per_s, call_seconds, step_seconds) from the median seconds of cpu_adam_profile's passes:
    `few` = step + 4 calls + numel elements, `many` = step + 64 calls + numel, `double` = step + 4 calls + 2 numel,
    and `floor`, the memory floor over numel elements at the same threads (None: not measured).

    Each unknown is a difference of two medians, and noise can push one past what is physically possible, so
    each is kept within bounds: no negative costs; the elements take no more than what the first pass left
    after its calls (the step's own cost is not negative); and no less than the memory floor's bytes allow.
    """
    call = max(0.0, (many - few) / 60)
    remainder = max(0.0, few - 4 * call) / numel  # seconds a parameter if the step cost nothing
    least = floor * FORM_BYTES[form] / FLOOR_BYTES / numel if floor else 0.0
    per_param = (double - few) / numel
    per_param = min(per_param, remainder) if per_param > 0 else remainder
    per_param = max(per_param, least) or few / numel
    step = max(0.0, few - 4 * call - numel * per_param)
    return 1 / per_param, call, step


def cpu_adam_profile(
    *,
    threads: int | None = None,
    form: str = "fp32",
    numel: int = 4_000_000,
    repeats: int = 5,
    impl: str = "auto",
) -> AdamProfile:
    """Measure the CPU Adam as the engine runs it: caches cold, one call per tensor.

    Three unknowns, three passes, each after the caches were emptied: `numel` elements as 4 tensors, the
    same elements as 64 tensors, and twice the elements as 4 tensors. The 60 extra calls cost the second
    pass's extra time: each call's Python path (argument checks, cffi, starting threads) runs after the
    previous tensor's stream has emptied the caches, as between the engine's units. The extra elements of the
    third pass give the throughput. What the first pass took beyond its calls and its elements is paid once
    a step. With the C kernel a fourth pass times the memory floor over `numel` elements at the same threads:
    no update moves its bytes faster, so it bounds the throughput from above (fit_adam_cost). `impl` "auto"
    is our C kernel, or torch's fused Adam where no C compiler exists (then `note` says so); "torch" measures
    torch's fused Adam on purpose.
    """
    if form not in ADAM_FORMS:
        raise ValueError(f"form must be one of {', '.join(ADAM_FORMS)}; got {form!r}")
    threads = threads or default_threads()
    if impl not in ("auto", "torch"):
        raise ValueError(f"impl must be 'auto' or 'torch'; got {impl!r}")
    name, note = "C SIMD", ""
    if impl == "auto":
        try:
            build()
        except CompilerNotFound as err:
            note = f"measured torch.optim.Adam(fused=True) instead of the C kernel: {err}"
    if impl == "torch" or note:
        name = "torch fused"
        if form != "fp32":
            form, why = "fp32", "torch's fused Adam reads fp32 gradients only: form fp32 measured"
            note = f"{note}; {why}" if note else why
    previous_threads = torch.get_num_threads()
    # The same elements as 4 tensors and as 64, and twice as many as 4 tensors.
    shapes = {"few": (4, numel // 4), "many": (64, numel // 64), "double": (4, numel // 2)}
    try:
        if name == "torch fused":
            # Set once, not per step: re-sizing torch's thread pool takes milliseconds.
            torch.set_num_threads(threads)
            passes = {key: _torch_adam_pass(pieces, size) for key, (pieces, size) in shapes.items()}
        else:
            flat = _adam_buffers(4 * (numel // 2), form)  # shared by the passes
            passes = {
                key: _c_adam_pass(flat, pieces, size, threads) for key, (pieces, size) in shapes.items()
            }
            passes["floor"] = _floor_pass(flat, 4 * (numel // 4), threads)
        times = {key: [] for key in passes}
        flush = _cache_flusher()
        for run in passes.values():
            run()  # warm-up: first touches of the buffers
        for _ in range(repeats):  # interleaved, so that a burst of noise from elsewhere hits all alike
            for key, run in passes.items():
                flush()
                started = time.perf_counter()
                run()
                times[key].append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous_threads)
    medians = {key: statistics.median(values) for key, values in times.items()}
    elements = 4 * (numel // 4)
    floor = medians.get("floor")
    params_per_s, call, step = fit_adam_cost(
        elements, medians["few"], medians["many"], medians["double"], floor, form
    )
    floor_gb_per_s = FLOOR_BYTES * elements / floor / 1e9 if floor else None
    return AdamProfile(name, form, threads, params_per_s, call, step, note, floor_gb_per_s)


@dataclass(frozen=True)
class CacheProfile:
    """The CPU Adam's speed when it updates the same states step after step, by how many bytes they take."""

    cached_params_per_s: float  # states that stay in the cache: the fastest probe's
    cache_bytes: int  # bytes of states the cache keeps from one step to the next (see cache_profile)
    probes: tuple[tuple[int, float], ...]  # (bytes of states, parameters a second)


def cache_profile(memory: AdamProfile, last_level: int, repeats: int = 5) -> CacheProfile:
    """Repeat the engine's pass over the same states, with nothing in between, at sizes from a sixteenth of
    the last-level cache (`last_level` bytes) to twice it, doubling, at the threads and form of `memory` (a
    cold profile); at most 512 MiB of states.

    While the states fit, each pass finds them in the cache and runs faster; once they are too large, each
    pass evicts the lines the next one needs and runs at memory's speed, as the largest probe does. Where
    between the two it turns is measured here, not read from the cache's size: a virtual machine is told its
    socket's whole cache and shares it with its neighbours, and other programs take their part. The
    performance model takes the share of the states still cached to fall linearly, from all of them for tiny
    states to none at `cache_bytes`; the time a parameter is then halfway between the two speeds at half of
    cache_bytes, so cache_bytes is twice the size at which the probes cross halfway.
    """
    per_param, threads, form = STATE_BYTES[memory.form], memory.threads, memory.form
    # One call's own cost, on a tensor too small to take any time: taken off each probe's single call.
    call = median_seconds(_c_adam_pass(_adam_buffers(64, form), 1, 64, threads), 4 * repeats)
    sizes = sorted({min(last_level // 16 * 2**k, 2**29) // per_param // 64 * 64 for k in range(6)})
    runs = {numel: _c_adam_pass(_adam_buffers(numel, form), 1, numel, threads) for numel in sizes if numel}
    times = {numel: [] for numel in runs}
    for _ in range(repeats):  # rounds over every size, so that a burst of noise hits all alike
        for numel, run in runs.items():
            # Bring the states in (and the other probes' out). One pass is not enough: on the course's machine
            # a pass over 8 MiB of states got faster for three passes or more, as the cache came to keep them.
            for _ in range(3):
                run()
            started = time.perf_counter()
            run()
            times[numel].append(time.perf_counter() - started)
    probes = [(n * per_param, n / max(statistics.median(t) - call, 1e-9)) for n, t in times.items()]
    # The cache's speed is the fastest probe's (the smallest states pay the most for what is left of a call).
    cached = max(memory.params_per_s, *(rate for _, rate in probes))
    return CacheProfile(cached, cache_bytes_from_probes(probes, cached), tuple(probes))


def cache_bytes_from_probes(probes: list[tuple[int, float]], cached: float) -> int:
    """Twice the bytes of states (probes: (bytes, parameters a second), smallest first) at which the time a
    parameter crosses halfway from the `cached` speed to the largest probe's, memory's: interpolated between
    the first probe past halfway beyond the fastest one and the probe before it; 0 where the fastest is no
    faster than halfway (the cache keeps none). Searching from the fastest probe, not the smallest: the
    smallest states can run slower than the next ones, as what is left of a call weighs more on them."""
    seconds = [(size, 1 / rate) for size, rate in probes]
    halfway = (1 / cached + seconds[-1][1]) / 2
    fastest = min(range(len(seconds)), key=lambda i: seconds[i][1])
    # The last probe is at or past halfway: the search always ends.
    past = next(i for i in range(fastest, len(seconds)) if seconds[i][1] >= halfway)
    if past == fastest:
        return 0
    (size0, t0), (size1, t1) = seconds[past - 1], seconds[past]
    return round(2 * (size0 + (halfway - t0) / (t1 - t0) * (size1 - size0)))


def cpu_adam_sweep(
    max_threads: int | None = None,
    *,
    forms: tuple[str, ...] = ("fp32", "fp16"),
    numel: int = 4_000_000,
    repeats: int = 5,
    with_torch: bool = True,
) -> list[AdamProfile]:
    """The C Adam's throughput against its thread count 1..max_threads, per form, and torch's fused Adam.

    Memory bandwidth, not cores, bounds a one-pass Adam: throughput rises with threads until the threads
    together saturate the memory channels, then stays flat.
    """
    max_threads = max_threads or default_threads()
    profiles = []
    for threads in range(1, max_threads + 1):
        for form in forms:
            profiles.append(cpu_adam_profile(threads=threads, form=form, numel=numel, repeats=repeats))
        if with_torch:
            profiles.append(cpu_adam_profile(threads=threads, numel=numel, repeats=repeats, impl="torch"))
    return profiles


def matmul_tflops(device=None, dtype: torch.dtype | None = None, size: int = 1024, repeats: int = 5) -> float:
    """Dense matmul speed in TFLOP/s (2 n^3 FLOPs per n x n product): fp16 on CUDA, fp32 on the CPU."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def product():
        torch.mm(a, b)
        sync()

    return 2 * size**3 / median_seconds(product, repeats) / 1e12
