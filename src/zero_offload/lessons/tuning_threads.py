"""Lesson 4, section 4: CPU Adam against thread counts, the cost of a call, and sharing cores with torch.

Every comparison interleaves its cases round by round and takes medians: on a shared machine a busy spell then
slows every case alike instead of one of them.
"""

from __future__ import annotations

import math
import statistics
import threading
import time

import torch

from ..tuning import bandwidth, cpu_adam_update
from ..tuning.cpu_adam import memory_floor


def thread_kinds(n: int) -> dict:
    """name -> (bytes a parameter, one step on t threads), each on its own buffers of n parameters."""
    w32, g32, m32, v32 = torch.zeros(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    out16 = torch.empty(n, dtype=torch.float16)
    param = torch.zeros(n, requires_grad=True)
    param.grad = torch.randn(n)
    fused = torch.optim.Adam(
        [param], lr=1e-3, fused=True
    )  # torch's threads: set_num_threads(t) before the call
    return {
        "C fp32": (28, lambda t: cpu_adam_update(w32, g32, m32, v32, step=1, lr=1e-3, threads=t)),
        "C fp32 -> fp16": (
            30,
            lambda t: cpu_adam_update(w32, g32, m32, v32, step=1, lr=1e-3, out=out16, threads=t),
        ),
        "torch fused": (28, lambda t: fused.step()),
        "memory floor": (28, lambda t: memory_floor(w32, g32, m32, v32, threads=t)),
    }


def thread_sweep(kinds: dict, n: int, max_threads: int, rounds: int) -> dict:
    """{(kind, threads): parameters/s}, medians over `rounds`, each timing after the caches were flushed.

    The flush writes a buffer larger than the last-level cache: after backward the optimizer states are long out
    of the caches, and a warm-cache timing would flatter every kind."""
    flush_src, flush_dst = torch.ones(bandwidth.FLUSH_BYTES // 4), torch.empty(bandwidth.FLUSH_BYTES // 4)
    times = {(kind, t): [] for kind in kinds for t in range(1, max_threads + 1)}
    try:
        for _ in range(rounds):
            for t in range(1, max_threads + 1):
                torch.set_num_threads(t)  # torch's pool is resized here, untimed
                for kind, (_, step) in kinds.items():
                    step(t)  # warm: a resized pool starts its threads on first use
                    flush_dst.copy_(flush_src)
                    started = time.perf_counter()
                    step(t)
                    times[kind, t].append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(1)
    return {key: n / statistics.median(t) for key, t in times.items()}


def format_threads(rates: dict, kinds: dict, n: int, max_threads: int, rounds: int, cores: int) -> str:
    lines = [
        f"{n:,} parameters, cold caches; million parameters/s (GB/s); medians of {rounds} rounds\n",
        f"{'threads':>7}" + "".join(f"{kind:>18}" for kind in kinds),
    ]
    for t in range(1, max_threads + 1):
        cells = [
            f"{rates[k, t] / 1e6:.0f} ({nbytes * rates[k, t] / 1e9:4.1f})" for k, (nbytes, _) in kinds.items()
        ]
        lines.append(f"{t:>7}" + "".join(f"{c:>18}" for c in cells))
    best = {kind: max(range(1, max_threads + 1), key=lambda t, k=kind: rates[k, t]) for kind in kinds}
    lines.append("\nfastest thread count: " + ", ".join(f"{k} {t}" for k, t in best.items()))
    lines.append(
        f"C fp32 at {cores} threads vs 1: {rates['C fp32', cores] / rates['C fp32', 1]:.2f}x; "
        f"memory floor: {rates['memory floor', cores] / rates['memory floor', 1]:.2f}x"
    )
    return "\n".join(lines)


def call_overhead_us(threads: int, n: int = 1024, calls: int = 200) -> float:
    """Microseconds one cpu_adam_update call costs on n parameters: Python checks, cffi, starting threads."""
    small = [torch.zeros(n) for _ in range(4)]
    out = torch.empty(n, dtype=torch.float16)
    seconds = bandwidth.median_seconds(
        lambda: [cpu_adam_update(*small, step=1, lr=1e-3, out=out, threads=threads) for _ in range(calls)],
        repeats=5,
    )
    return seconds / calls * 1e6


class Contention:
    """The C Adam (fp16 in, fp16 out) and a torch.mm loop in a background thread, alone and at the same time."""

    def __init__(self, n: int, seconds: float):
        self.n, self.seconds = n, seconds  # how long each side is timed
        self.buffers = [
            torch.zeros(n),
            torch.randn(n).half(),
            torch.zeros(n),
            torch.zeros(n),
            torch.empty(n, dtype=torch.float16),
        ]

    def adam_ms(self, threads: int) -> float:
        """Median ms of the C Adam called again and again for `self.seconds` (at least 5 calls)."""
        w, g, m, v, out = self.buffers
        times, until = [], time.perf_counter() + self.seconds
        while len(times) < 5 or time.perf_counter() < until:
            started = time.perf_counter()
            cpu_adam_update(w, g, m, v, step=1, lr=1e-3, out=out, threads=threads)
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1e3

    @staticmethod
    def _matmuls(stop: threading.Event, counter: list) -> None:
        a = torch.randn(256, 256)
        while not stop.is_set():
            torch.mm(a, a)
            counter[0] += 1

    def run_pair(self, torch_threads: int, adam_threads: int | None):
        """(matmuls/s, Adam ms) with the matmul loop on torch_threads and, unless None, the C Adam meanwhile."""
        torch.set_num_threads(torch_threads)
        stop, counter = threading.Event(), [0]
        worker = threading.Thread(target=self._matmuls, args=(stop, counter))
        worker.start()
        time.sleep(0.05)  # let the loop get going
        count0, started = counter[0], time.perf_counter()
        ms = self.adam_ms(adam_threads) if adam_threads else time.sleep(self.seconds)
        # Alone, the loop is timed until it has done at least one matmul: on a busy machine a short window can
        # end before the thread ran at all, and a rate of 0 alone would say nothing. Together, 0 is an answer.
        while not adam_threads and counter[0] == count0 and time.perf_counter() - started < 10:
            time.sleep(0.001)
        rate = (counter[0] - count0) / (time.perf_counter() - started)
        stop.set()
        worker.join()
        torch.set_num_threads(1)
        return rate, ms

    def measure(self, pairs, rounds: int) -> dict:
        """{(torch threads, Adam threads): {"mm alone", "adam alone", "mm busy", "adam busy": median}}."""
        results = {pair: {"mm alone": [], "adam alone": [], "mm busy": [], "adam busy": []} for pair in pairs}
        for _ in range(rounds):
            for torch_threads, adam_threads in pairs:
                r = results[torch_threads, adam_threads]
                r["mm alone"].append(self.run_pair(torch_threads, None)[0])
                r["adam alone"].append(self.adam_ms(adam_threads))
                rate, ms = self.run_pair(torch_threads, adam_threads)
                r["mm busy"].append(rate)
                r["adam busy"].append(ms)
        return {pair: {k: statistics.median(v) for k, v in r.items()} for pair, r in results.items()}


def _share(together: float, alone: float) -> float:
    """together / alone; NaN (printed "nan") where the loop did nothing alone, which no share can be taken of."""
    return together / alone if alone > 0 else math.nan


def format_contention(medians: dict, n: int, cores: int) -> str:
    lines = [
        f"C Adam over {n:,} parameters (fp16 in, fp16 out) and torch.mm 256 x 256 in a loop, {cores} cores\n",
        f"{'torch threads':>13}{'Adam threads':>13}{'sum':>5}{'Adam ms alone':>15}{'together':>10}"
        f"{'matmuls/s alone':>17}{'together':>10}{'work done together':>20}",
    ]
    for (torch_threads, adam_threads), med in medians.items():
        # Each side's speed together as a share of its speed alone, added up: 2.0 if they never got in each
        # other's way.
        work = med["adam alone"] / med["adam busy"] + _share(med["mm busy"], med["mm alone"])
        lines.append(
            f"{torch_threads:>13}{adam_threads:>13}{torch_threads + adam_threads:>5}"
            f"{med['adam alone']:>15.2f}{med['adam busy']:>10.2f}{med['mm alone']:>17,.0f}"
            f"{med['mm busy']:>10,.0f}{work:>20.2f}"
        )
    return "\n".join(lines)
