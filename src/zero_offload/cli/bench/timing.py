"""How `make bench` times: medians in milliseconds, rounds that interleave the contenders, and a quiet machine.

A shared machine has slow spells (another process, the kernel handing memory back): a median ignores a slow
repeat, interleaving spreads a slow spell over every contender alike, and waiting for quiet keeps a known one
out of the timing altogether.
"""

from __future__ import annotations

import statistics
import time

from tqdm import tqdm

from ...tuning.timing import median_seconds


def median_ms(fn, repeats: int, warmup: int = 2) -> float:
    return median_seconds(fn, repeats, warmup=warmup) * 1000


def interleaved_rounds(fns: dict, rounds: int, calls: int = 3, desc: str = "") -> dict[str, list[float]]:
    """Each function's ms in each round. Every round times every function (`calls` calls each, their median), so
    a slow spell of a shared machine falls on all of them alike instead of on whichever happened to run then."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm up: first-touch page faults, a compile, thread start-up
    for _ in tqdm(range(rounds), desc=desc, unit="round"):
        for name, fn in fns.items():
            times[name].append(median_ms(fn, calls, warmup=0))
    return times


def interleaved_ms(fns: dict, rounds: int, calls: int = 3, desc: str = "") -> dict[str, float]:
    """Median ms of each function over `interleaved_rounds`."""
    times = interleaved_rounds(fns, rounds, calls, desc)
    return {name: statistics.median(values) for name, values in times.items()}


def _busy_fraction(seconds: float) -> float | None:
    """The share of all cores' time spent busy over the next `seconds` (Linux /proc/stat); None elsewhere."""

    def sample():
        with open("/proc/stat") as stat:
            ticks = [int(v) for v in stat.readline().split()[1:]]
        return ticks[3] + ticks[4], sum(ticks)  # idle + iowait, total

    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except OSError:
        return None
    return 1 - (idle1 - idle0) / max(total1 - total0, 1)


def wait_until_quiet(limit: float = 90.0, threshold: float = 0.1) -> float:
    """Wait until the machine is idle (under `threshold` busy for two seconds running), at most `limit` seconds;
    the seconds waited. Once, after the 1B run exited, kernel threads (kworker) kept both cores busy for about
    20 s handing its 19 GB back: a timing started then charges that work to whichever schedule runs beside it."""
    start, quiet = time.perf_counter(), 0
    while quiet < 2 and time.perf_counter() - start < limit:
        busy = _busy_fraction(1.0)
        if busy is None:
            break
        quiet = quiet + 1 if busy < threshold else 0
    return time.perf_counter() - start
