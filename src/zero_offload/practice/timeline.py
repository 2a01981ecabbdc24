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
one lane per stage, time running left to right (timeline_plots.py). Only the last `keep_steps` steps are kept.

`engine.timeline(trace="trace.json")` writes the same spans as a trace to zoom into: open ui.perfetto.dev and
choose "Open trace file", or open chrome://tracing in Chrome and press "Load". Each rank is a process there,
and each part of the machine that runs a stage is a thread of it: the device's compute, the collectives, the
copies down and up (one copy engine each way on a GPU), the CPU running Adam, the NVMe drive.

Which clock: on the emulated device a stage's work runs while the host waits for it, so the host's clock times
it. A GPU runs kernels and copies asynchronously: the host's time around `model(x)` or a non-blocking copy is
only how long the launch took. There the device stages are timed by CUDA events recorded on the stream that runs
them, and put on the host's clock only when the spans are read, through one reference event whose host time is
known. Host work (the CPU's Adam, the NVMe tier) keeps the host's clock everywhere.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..implementation.durable import write_temp
from .spans import DEVICE_STAGES, STAGES, Span
from .timeline_plots import plot_timeline


@dataclass
class AdamClock:
    """What `Timeline.adam()` measured: how long its Adam ran (set when the block ends)."""

    seconds: float = 0.0


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

    def begin_step(self, step: int) -> None:
        """The spans recorded from now on belong to optimizer step `step` (the engine calls it after each step)."""
        self.step = step

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

    @contextmanager
    def adam(self):
        """Time the optimizer's Adam: its span here, and the seconds it ran on the `AdamClock` this yields
        (the step's report gives them as adam_seconds). Every updater's Adam is timed by this one stopwatch,
        on the host's clock: the host runs the offloaded Adam, and the device's Adam is launched from it."""
        clock = AdamClock()
        start = time.perf_counter()
        try:
            yield clock
        finally:
            end = time.perf_counter()
            clock.seconds = end - start
            self.add("Adam", start, end)

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


# -- the trace file: the Trace Event Format that ui.perfetto.dev and chrome://tracing read ---------------------

# Each stage on the part of the machine that runs it on real hardware: the trace's threads, in this order.
TRACE_THREADS = (
    "device compute",
    "collectives",
    "copy down (D2H)",
    "NVMe",
    "host (CPU Adam)",
    "copy up (H2D)",
)
THREAD_OF_STAGE = {
    "forward": "device compute",
    "backward": "device compute",
    "reduce": "collectives",
    "all-gather": "collectives",
    "D2H": "copy down (D2H)",
    "H2D": "copy up (H2D)",
    "Adam": "host (CPU Adam)",
    "NVMe read": "NVMe",
    "NVMe write": "NVMe",
}


def _rows(spans: list[Span]) -> list[tuple[str, list[Span]]]:
    """(thread name, its spans) for each thread of one rank, no two spans of a thread overlapping.

    The viewers draw one thread's events as a stack that must nest; two reduce-scatters in flight at once, or a
    prefetched all-gather beside them, would be cut or dropped there. Each such span goes to a second row of
    its thread ("collectives (2)"), the first row that is free when it starts."""
    rows = []
    for thread in TRACE_THREADS:
        mine: list[list[Span]] = []
        for span in sorted((s for s in spans if THREAD_OF_STAGE[s.stage] == thread), key=lambda s: s.start):
            free = next((row for row in mine if row[-1].end <= span.start), None)
            if free is None:
                mine.append(free := [])
            free.append(span)
        rows += [(thread if n == 0 else f"{thread} ({n + 1})", row) for n, row in enumerate(mine)]
    return rows


def _microseconds(seconds: float) -> float:
    return round(seconds * 1e6, 3)  # to the nanosecond: no clock here resolves finer


def trace_events(spans_by_rank: list[list[Span]]) -> list[dict]:
    """The trace's events: a name for every rank and thread, and a complete event for each span, in
    microseconds since the earliest span of any rank."""
    for span in (s for spans in spans_by_rank for s in spans):
        _check_stage(span.stage)
        if span.end < span.start:  # both ends come from clocks that only go forward: it was timed wrong
            raise ValueError(f"{span} ends before it starts; a span's end must be read after its start")
    origin = min((s.start for spans in spans_by_rank for s in spans), default=0.0)
    events = []
    for rank, spans in enumerate(spans_by_rank):
        pid = rank + 1  # pid 0 is the kernel's idle task in a Linux trace, and Perfetto treats it as such
        events += [
            _meta("process_name", pid, 0, name=f"rank {rank}"),
            _meta("process_sort_index", pid, 0, sort_index=rank),
        ]
        for tid, (thread, row) in enumerate(_rows(spans), start=1):
            events += [
                _meta("thread_name", pid, tid, name=thread),
                _meta("thread_sort_index", pid, tid, sort_index=tid),
            ]
            events += [_complete(span, origin, pid, tid, thread) for span in row]
    return events


def _complete(span: Span, origin: float, pid: int, tid: int, thread: str) -> dict:
    """A complete event ("X"): its start and its duration in one record."""
    start, end = _microseconds(span.start - origin), _microseconds(span.end - origin)
    category = thread.split(" (")[0]  # a second row of a thread belongs to the same category
    event = {"name": span.stage, "cat": category, "ph": "X", "ts": start, "dur": round(end - start, 3)}
    return {**event, "pid": pid, "tid": tid, "args": {"step": span.step}}


def _meta(kind: str, pid: int, tid: int, **args) -> dict:
    """A metadata event ("M"): the name or the place in the list of a process (a rank) or a thread."""
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def write_trace(spans_by_rank: list[list[Span]], path: str | Path) -> Path:
    """Write the spans of every rank as a trace-event JSON file at `path`, whole or not at all."""
    path = Path(path)
    text = json.dumps({"traceEvents": trace_events(spans_by_rank), "displayTimeUnit": "ms"})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = write_temp(path, lambda file: file.write(text.encode()))
        try:
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
    except OSError as err:
        raise OSError(
            err.errno, f"could not write the trace {path}: {err.strerror or err}", str(path)
        ) from err
    return path


def gather_timeline(
    timeline: Timeline, comm, path=None, *, title: str | None = None, trace=None
) -> list[list[Span]]:
    """Every rank's spans (all ranks must call this); rank 0 draws their Gantt chart at `path` and writes them
    as a trace file (Perfetto, chrome://tracing) at `trace`, each if given."""
    spans = timeline.spans  # a list of its own already
    by_rank = [spans]
    if comm.distributed:
        by_rank = [None] * comm.world_size
        torch.distributed.all_gather_object(by_rank, spans, group=comm.group)
    if trace is not None and comm.rank == 0:
        write_trace(by_rank, trace)
    if path is not None and comm.rank == 0:
        plot_timeline(by_rank, path, title=title or f"last {timeline.keep_steps} steps, per rank")
    return by_rank
