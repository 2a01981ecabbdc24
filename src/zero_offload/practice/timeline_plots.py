"""Pictures of the timeline (practice/timeline.py): every kept step at once, or one step of several schedules.

`plot_timeline` draws what `engine.timeline(path)` gathered: one band per rank, one lane per stage, the last
steps side by side. At that scale a step's copies and its Adam are slivers. `plot_step` cuts one optimizer
step out of each schedule (serial, overlapped, delayed, ...) and stacks them on one time axis, so that the
schedules' lengths compare and the widths of the short stages can be read. `representative_step` picks one
typical step out of many (the median-length one after the first), so that a picture of one schedule shows a
step zoomed rather than several turns of steps with the gaps between them.
"""

from __future__ import annotations

from pathlib import Path

from .spans import STAGES, Span

# A bar is drawn at least this wide, as a fraction of the axis, so that a span too short to measure still shows.
MIN_BAR_FRACTION = 0.002


def _bars(spans: list[Span], stage: str, origin: float, min_width_ms: float) -> list[tuple[float, float]]:
    """(start, width) in ms from `origin` of each span of `stage`, as broken_barh wants them."""
    return [
        ((s.start - origin) * 1e3, max((s.end - s.start) * 1e3, min_width_ms))
        for s in spans
        if s.stage == stage
    ]


def _lanes(span_lists) -> list[str]:
    """The stages that occur in any of `span_lists`, in the order a step runs them."""
    return [stage for stage in STAGES if any(s.stage == stage for spans in span_lists for s in spans)]


def _colors(plt) -> dict[str, tuple]:
    return dict(zip(STAGES, plt.get_cmap("tab10").colors, strict=False))


def plot_timeline(spans_by_rank: list[list[Span]], path: str | Path, *, title: str) -> Path:
    """A Gantt chart: one band of lanes per rank, one lane per stage."""
    from ..plots import plt, save_figure

    lanes, colors = _lanes(spans_by_rank), _colors(plt)
    fig, ax = plt.subplots(figsize=(10, 0.35 * max(1, len(lanes) * len(spans_by_rank)) + 1.4))
    every = [s for spans in spans_by_rank for s in spans]
    origin = min((s.start for s in every), default=0.0)
    min_width = MIN_BAR_FRACTION * (max((s.end for s in every), default=origin) - origin) * 1e3
    ticks, labels = [], []
    for rank, spans in enumerate(spans_by_rank):
        for lane, stage in enumerate(lanes):
            y = rank * (len(lanes) + 1) + lane
            ax.broken_barh(_bars(spans, stage, origin, min_width), (y - 0.4, 0.8), color=colors[stage])
            ticks.append(y)
            labels.append(f"rank {rank} {stage}" if len(spans_by_rank) > 1 else stage)
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    return save_figure(fig, path)


def step_to_show(spans_by_name: dict[str, list[Span]]) -> int:
    """The last step every schedule has completed: the largest step they all hold that each also holds a later
    step of (the newest step may still be unfinished, or be missing the work a schedule delays into the next);
    if no step is followed by another everywhere, the largest step they all hold."""
    step_sets = [{s.step for s in spans} for spans in spans_by_name.values()]
    common = set.intersection(*step_sets) if step_sets else set()
    if not common:
        raise ValueError(
            f"no optimizer step has spans in every schedule ({', '.join(spans_by_name) or 'none'})"
        )
    complete = [step for step in common if all(step < max(steps) for steps in step_sets)]
    return max(complete or common)


def representative_step(spans: list[Span]) -> int:
    """The step of `spans` to show as the typical one (`plot_step` cuts it out and starts its time at 0).

    A step's length runs from its first span's start to its last span's end. The oldest step held is left out
    when there are three or more (its spans may have been trimmed, or it carries the warm-up), and so is the
    newest (it may be unfinished, or lack the work a schedule delays into the next step). Of the steps left,
    the one of median length is chosen (the shorter middle one of an even count, the earlier of equal ones):
    a step stretched by a pause between turns, or by a hiccup of the machine, is never the one shown."""
    if not spans:
        raise ValueError("no spans: the timeline holds no step")
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for s in spans:
        first[s.step] = min(first.get(s.step, s.start), s.start)
        last[s.step] = max(last.get(s.step, s.end), s.end)
    steps = sorted(first)
    if len(steps) >= 3:
        steps = steps[1:-1]
    ranked = sorted(steps, key=lambda step: (last[step] - first[step], step))
    return ranked[(len(ranked) - 1) // 2]


def plot_step(
    spans_by_name: dict[str, list[Span]], path: str | Path, *, step: int | None = None, title: str
) -> Path:
    """One panel per schedule, each showing one optimizer step (by default `step_to_show`), time from that
    step's first span in ms, one lane per stage, on one shared time axis."""
    from ..plots import plt, save_figure

    step = step_to_show(spans_by_name) if step is None else step
    steps = {name: [s for s in spans if s.step == step] for name, spans in spans_by_name.items()}
    if missing := [name for name, spans in steps.items() if not spans]:
        raise ValueError(f"step {step} has no spans in {', '.join(missing)}")
    origins = {name: min(s.start for s in spans) for name, spans in steps.items()}
    walls_ms = {name: (max(s.end for s in spans) - origins[name]) * 1e3 for name, spans in steps.items()}
    axis_ms = max(walls_ms.values()) or 1.0  # a step of zero-length spans still gets an axis
    min_width = MIN_BAR_FRACTION * axis_ms
    lanes, colors = (
        _lanes(steps.values()),
        _colors(plt),
    )  # the same lanes in every panel, to compare row by row
    fig, axes = plt.subplots(
        len(steps), 1, sharex=True, squeeze=False, figsize=(10, len(steps) * (0.3 * len(lanes) + 0.9) + 0.8)
    )
    for ax, (name, spans) in zip(axes[:, 0], steps.items(), strict=True):
        for lane, stage in enumerate(lanes):
            ax.broken_barh(
                _bars(spans, stage, origins[name], min_width), (lane - 0.4, 0.8), color=colors[stage]
            )
        ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
        ax.set_ylim(len(lanes) - 0.5, -0.5)  # the first stage on top
        ax.set_title(f"{name}: step {step}, {walls_ms[name]:.1f} ms", fontsize=10)
    axes[-1, 0].set_xlim(0, axis_ms * 1.02)
    axes[-1, 0].set_xlabel("time since the step's first span (ms)")
    fig.suptitle(title)
    return save_figure(fig, path)
