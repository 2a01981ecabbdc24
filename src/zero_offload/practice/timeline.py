"""The timeline of a training step: when each stage ran, on each rank.

ZeRO-Offload is fast only when the copies and the CPU's Adam hide behind the device's work; whether they do is a
question of *when*, which totals cannot answer. The engine records the start and end of every stage:

    forward, backward          the model's passes on the device
    reduce                     a gradient bucket's reduce-scatter (from launch to completion)
    D2H, H2D                   each copy over the link (PCIe), gradients down and weights up
    NVMe read, NVMe write      sub-groups of optimizer states read ahead and written behind (the NVMe tier)
    Adam                       the optimizer step (on the host when offloaded)
    all-gather                 weights gathered after the update, or before a stage-3 layer runs

`engine.timeline(path)` collects the spans of every rank and draws them as a Gantt chart: one band per rank,
one lane per stage, time running left to right. Only the last `keep_steps` steps are kept.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

STAGES = ("forward", "backward", "reduce", "D2H", "NVMe read", "Adam", "NVMe write", "H2D", "all-gather")


@dataclass(frozen=True)
class Span:
    stage: str
    step: int  # the optimizer step this work belongs to (engine.global_steps while it ran)
    start: float  # seconds since the timeline was made
    end: float


class Timeline:
    """Spans of the last `keep_steps` steps of one rank."""

    def __init__(self, keep_steps: int = 16):
        if keep_steps < 1:
            raise ValueError(f"keep_steps must be at least 1, got {keep_steps}")
        self.keep_steps = keep_steps
        self.origin = time.perf_counter()
        self.step = 0
        self.spans: deque[Span] = deque()

    def add(self, stage: str, start: float, end: float) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
        self.spans.append(Span(stage, self.step, start - self.origin, end - self.origin))
        while self.spans and self.spans[0].step <= self.step - self.keep_steps:
            self.spans.popleft()

    @contextmanager
    def span(self, stage: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, start, time.perf_counter())

    def until_done(self, stage: str, start: float, work):
        """A collective launched at `start`: its span ends now if it ran synchronously (`work` is None), else
        when someone waits for its handle, which this returns wrapped."""
        if work is None:
            self.add(stage, start, time.perf_counter())
            return None
        return _TimedWork(work, self, stage, start)


class _TimedWork:
    """A collective's handle that records its span when waited on."""

    def __init__(self, work, timeline: Timeline, stage: str, start: float):
        self.work, self.timeline, self.stage, self.start = work, timeline, stage, start

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self):
        result = self.work.wait()
        self.timeline.add(self.stage, self.start, time.perf_counter())
        return result


def plot_timeline(spans_by_rank: list[list[Span]], path: str | Path, *, title: str) -> Path:
    """A Gantt chart: one band of lanes per rank, one lane per stage."""
    from ..plots import _save, plt

    lanes = [stage for stage in STAGES if any(s.stage == stage for spans in spans_by_rank for s in spans)]
    colors = dict(zip(STAGES, plt.get_cmap("tab10").colors, strict=False))
    fig, ax = plt.subplots(figsize=(10, 0.35 * max(1, len(lanes) * len(spans_by_rank)) + 1.4))
    origin = min((s.start for spans in spans_by_rank for s in spans), default=0.0)
    ticks, labels = [], []
    for rank, spans in enumerate(spans_by_rank):
        for lane, stage in enumerate(lanes):
            y = rank * (len(lanes) + 1) + lane
            bars = [
                ((s.start - origin) * 1e3, max((s.end - s.start) * 1e3, 0.02))
                for s in spans
                if s.stage == stage
            ]
            ax.broken_barh(bars, (y - 0.4, 0.8), color=colors[stage])
            ticks.append(y)
            labels.append(f"rank {rank} {stage}" if len(spans_by_rank) > 1 else stage)
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    return _save(fig, path)
