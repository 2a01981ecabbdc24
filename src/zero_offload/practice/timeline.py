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

Which clock: on the emulated device a stage's work runs while the host waits for it, so the host's clock times
it. A GPU runs kernels and copies asynchronously: the host's time around `model(x)` or a non-blocking copy is
only how long the launch took. There the device stages are timed by CUDA events recorded on the stream that runs
them, and put on the host's clock only when the spans are read, through one reference event whose host time is
known. Host work (the CPU's Adam, the NVMe tier) keeps the host's clock everywhere.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

STAGES = ("forward", "backward", "reduce", "D2H", "NVMe read", "Adam", "NVMe write", "H2D", "all-gather")
# The stages whose work a GPU queues and runs later: on CUDA they are timed by events, the others by the host.
DEVICE_STAGES = frozenset({"forward", "backward", "reduce", "D2H", "H2D", "all-gather"})


@dataclass(frozen=True)
class Span:
    stage: str
    step: int  # the optimizer step this work belongs to (engine.global_steps while it ran)
    start: float  # seconds since the timeline was made
    end: float


@dataclass(frozen=True)
class _Pending:
    """A device span whose events may not have happened yet: resolved into a Span when the spans are read."""

    stage: str
    step: int
    start: torch.cuda.Event
    end: torch.cuda.Event


class Timeline:
    """Spans of the last `keep_steps` steps of one rank.

    Given a CUDA `accelerator`, the device stages are timed by CUDA events; otherwise everything is timed by
    the host's `time.perf_counter()`.
    """

    def __init__(self, keep_steps: int = 16, *, accelerator=None):
        if keep_steps < 1:
            raise ValueError(f"keep_steps must be at least 1, got {keep_steps}")
        self.keep_steps = keep_steps
        self.origin = time.perf_counter()
        self.step = 0
        self._spans: deque[Span | _Pending] = deque()
        # The pipeline's copy thread records spans while the main thread does.
        self._lock = threading.Lock()
        self._device = accelerator.device if accelerator is not None and accelerator.name == "cuda" else None
        if self._device is not None:
            # The one synchronization: afterwards the reference event's host time is known, and every other
            # event is placed on the host clock by its distance from the reference, measured by the device.
            self._reference = torch.cuda.Event(enable_timing=True)
            self._reference.record(torch.cuda.current_stream(self._device))
            self._reference.synchronize()
            self._reference_host = time.perf_counter()

    @property
    def spans(self) -> list[Span]:
        """The kept spans, oldest first. On CUDA this waits for the events of the spans not yet read."""
        with self._lock:
            self._spans = deque(self._resolve(s) if isinstance(s, _Pending) else s for s in self._spans)
            return list(self._spans)

    def _resolve(self, pending: _Pending) -> Span:
        # Only these two events: synchronizing the device would also wait for work queued after the span.
        pending.start.synchronize()
        pending.end.synchronize()
        start, end = (
            self._reference_host + self._reference.elapsed_time(event) / 1e3 - self.origin
            for event in (pending.start, pending.end)
        )
        return Span(pending.stage, pending.step, start, end)

    def _append(self, item: Span | _Pending) -> None:
        with self._lock:
            self._spans.append(item)
            while self._spans and self._spans[0].step <= self.step - self.keep_steps:
                self._spans.popleft()

    def add(self, stage: str, start: float, end: float) -> None:
        """Record `stage` from `start` to `end`, two readings of the host's `time.perf_counter()`."""
        _check_stage(stage)
        self._append(Span(stage, self.step, start - self.origin, end - self.origin))

    def mark(self, stage: str) -> float | torch.cuda.Event:
        """The start of `stage`'s work, for `finish`: on CUDA, for a device stage, an event recorded on the
        current stream (inside `torch.cuda.stream(s)`, on `s`); else the host's time now."""
        _check_stage(stage)
        if self._device is None or stage not in DEVICE_STAGES:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return event

    def finish(self, stage: str, start: float | torch.cuda.Event) -> None:
        """Record `stage` from `start` (a `mark`) to now, on the clock `start` was read from."""
        if isinstance(start, float):
            return self.add(stage, start, time.perf_counter())
        end = self.mark(stage)
        self._append(_Pending(stage, self.step, start, end))

    @contextmanager
    def span(self, stage: str):
        start = self.mark(stage)
        try:
            yield
        finally:
            self.finish(stage, start)

    def until_done(self, stage: str, start: float | torch.cuda.Event, work):
        """A collective launched at `start` (a `mark`): its span ends now if it ran synchronously (`work` is
        None), else when someone waits for its handle, which this returns wrapped."""
        if work is None:
            self.finish(stage, start)
            return None
        return _TimedWork(work, self, stage, start)


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")


class _TimedWork:
    """A collective's handle that records its span when waited on.

    On CUDA, `wait()` makes the current stream wait for the collective, so the end event recorded after it
    completes once the collective has (or once the stream's own earlier work has, if that ends later)."""

    def __init__(self, work, timeline: Timeline, stage: str, start: float | torch.cuda.Event):
        self.work, self.timeline, self.stage, self.start = work, timeline, stage, start

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self):
        result = self.work.wait()
        self.timeline.finish(self.stage, self.start)
        return result


def plot_timeline(spans_by_rank: list[list[Span]], path: str | Path, *, title: str) -> Path:
    """A Gantt chart: one band of lanes per rank, one lane per stage."""
    from ..plots import plt, save_figure

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
    return save_figure(fig, path)


def gather_timeline(timeline: Timeline, comm, path=None, *, title: str | None = None) -> list[list[Span]]:
    """Every rank's spans (all ranks must call this), and with `path` rank 0 draws their Gantt chart there."""
    spans = timeline.spans  # a list of its own already
    by_rank = [spans]
    if comm.distributed:
        by_rank = [None] * comm.world_size
        torch.distributed.all_gather_object(by_rank, spans, group=comm.group)
    if path is not None and comm.rank == 0:
        plot_timeline(by_rank, path, title=title or f"last {timeline.keep_steps} steps, per rank")
    return by_rank
