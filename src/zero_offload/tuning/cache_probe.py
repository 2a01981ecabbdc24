"""The cache probe: how fast the CPU Adam runs when its states stay in the last-level cache, and how many
bytes of states the cache keeps from one step to the next.

A step whose states fit in the cache runs at the cache's speed, not at memory's; the performance model
(perfmodel.cached_share) needs both speeds and where one turns into the other.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from .adam_probe import STATE_BYTES, AdamProfile, adam_buffers, c_adam_pass
from .timing import median_seconds


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
    call = median_seconds(c_adam_pass(adam_buffers(64, form), 1, 64, threads), 4 * repeats)
    sizes = sorted({min(last_level // 16 * 2**k, 2**29) // per_param // 64 * 64 for k in range(6)})
    runs = {numel: c_adam_pass(adam_buffers(numel, form), 1, numel, threads) for numel in sizes if numel}
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
