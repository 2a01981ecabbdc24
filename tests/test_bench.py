"""`make bench` helpers (the benchmark itself reports ratios and is run by `make bench`, not by the tests)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zero_offload.bench import _busy_fraction, wait_until_quiet


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) != os.cpu_count(),
    reason="/proc/stat counts every core of the machine: this process must be allowed on all of them",
)
def test_timing_waits_while_something_else_keeps_the_cores_busy():
    cores = len(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        busy = _busy_fraction(0.5)
        assert busy is not None and busy > 0.5
        assert wait_until_quiet(limit=3.0) >= 3.0  # never quiet: it gives up at the limit rather than hang
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
