"""The CPU Adam probes: what one step of our C Adam costs on this machine, as the engine runs it.

  cpu_adam_profile()  how many parameters a second the C Adam updates with its states cold (they come from
                      memory), what each call costs, what each step costs once, and the memory floor at the
                      same threads (its bytes, no arithmetic: the CPU Adam is bound by memory, and the floor
                      bounds its throughput and measures the bandwidth);
  cpu_adam_sweep()    the same against the thread count, and torch's fused Adam beside it.

How much faster it runs when its states stay in the cache is cache_probe.py's question.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .build import CPUAdamUnavailable, build
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


@functools.cache  # filling FLUSH_BYTES takes longer than a small probe: calibrate() runs several probes
def _cache_flusher() -> Callable[[], object]:
    buffer = torch.ones(FLUSH_BYTES // 4)  # written: its pages are real ones, not the shared zero page
    return lambda: buffer.sum()


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


def adam_buffers(total: int, form: str) -> list[torch.Tensor]:
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


def c_adam_pass(flat: list[torch.Tensor], pieces: int, numel: int, threads: int) -> Callable[[], None]:
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
        except CPUAdamUnavailable as err:
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
            flat = adam_buffers(4 * (numel // 2), form)  # shared by the passes
            passes = {key: c_adam_pass(flat, pieces, size, threads) for key, (pieces, size) in shapes.items()}
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
