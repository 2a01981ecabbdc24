"""How the probes time a piece of work: the median of several repeats.

One slow repeat (another process, a page fault) moves a mean but not a median, so every timing the probes and
`make bench` report is a median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


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
