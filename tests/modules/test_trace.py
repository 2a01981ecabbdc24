"""The timeline as a trace file (practice/timeline.py) and one step of several schedules (timeline_plots.py)."""

from __future__ import annotations

import json

import pytest
import torch

import zero_offload as zo
from tests.support.training import BATCH, SEQ, make_config
from zero_offload import plots
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.practice.timeline import Span, gather_timeline, write_trace
from zero_offload.practice.timeline_plots import plot_step, step_to_show
from zero_offload.workloads import TinyGPT, lm_loss

T0 = 12.5  # seconds since the timeline was made: the trace must start at 0 all the same
MS = 1e-3


def _span(stage, step, start_ms, end_ms, base=T0):
    return Span(stage, step, base + start_ms * MS, base + end_ms * MS)


def _rank_spans(shift_ms=0.0, step=0):
    """One offloaded step: backward's gradients go down while it runs, Adam on the host, weights back up."""
    stages = [("forward", 0, 1), ("backward", 1, 3), ("D2H", 2, 2.5), ("Adam", 2.5, 4), ("H2D", 4, 4.2)]
    return [_span(stage, step, start + shift_ms, end + shift_ms) for stage, start, end in stages]


def check_trace_format(trace: dict) -> None:
    """What Perfetto's JSON importer needs: every event named and placed, every used process and thread named."""
    assert isinstance(trace["traceEvents"], list) and trace["displayTimeUnit"] == "ms"
    named_processes, named_threads, used = set(), set(), set()
    for event in trace["traceEvents"]:
        assert isinstance(event["name"], str) and event["ph"] in {"X", "M"}, event
        assert type(event["pid"]) is int and type(event["tid"]) is int, event
        if event["ph"] == "X":
            assert isinstance(event["cat"], str), event
            for key in ("ts", "dur"):
                assert isinstance(event[key], (int, float)) and event[key] >= 0, event
            used.add((event["pid"], event["tid"]))
        elif event["name"] == "process_name":
            named_processes.add(event["pid"])
        elif event["name"] == "thread_name":
            named_threads.add((event["pid"], event["tid"]))
        assert isinstance(event.get("args", {}), dict), event
    assert used <= named_threads, "a thread without a name"
    assert {pid for pid, _ in used} <= named_processes, "a process without a name"


def _read(path) -> dict:
    trace = json.loads(path.read_text())
    check_trace_format(trace)
    return trace


def _names(trace, kind) -> dict:
    """pid (for process_name) or (pid, tid) (for thread_name) -> the name given."""
    return {
        e["pid"] if kind == "process_name" else (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == kind
    }


def _complete(trace) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def test_each_rank_is_a_process_and_each_span_an_event_in_microseconds(tmp_path):
    by_rank = [_rank_spans(), _rank_spans(shift_ms=0.5)]
    path = write_trace(by_rank, tmp_path / "sub" / "trace.json")  # the parent is made
    assert path == tmp_path / "sub" / "trace.json"
    trace = _read(path)
    processes = _names(trace, "process_name")
    assert sorted(processes.values()) == ["rank 0", "rank 1"]  # one pid a rank
    threads = _names(trace, "thread_name")
    for rank, spans in enumerate(by_rank):
        [pid] = [pid for pid, name in processes.items() if name == f"rank {rank}"]
        mine = sorted((e for e in _complete(trace) if e["pid"] == pid), key=lambda e: e["ts"])
        # The same stages in the same order of time as the spans given.
        assert [e["name"] for e in mine] == [s.stage for s in sorted(spans, key=lambda s: s.start)]
        assert all(e["args"]["step"] == 0 for e in mine)
        where = {e["name"]: threads[(pid, e["tid"])] for e in mine}
        assert where == {
            "forward": "device compute",
            "backward": "device compute",
            "D2H": "copy down (D2H)",
            "Adam": "host (CPU Adam)",
            "H2D": "copy up (H2D)",
        }
        shift = 500.0 * rank  # microseconds from the earliest span of all ranks, rank 0's forward
        assert [(e["ts"], e["dur"]) for e in mine] == [
            (0.0 + shift, 1000.0),
            (1000.0 + shift, 2000.0),
            (2000.0 + shift, 500.0),
            (2500.0 + shift, 1500.0),
            (4000.0 + shift, 200.0),
        ]
    assert {e["cat"] for e in _complete(trace)} == {"device compute", "copy down", "host", "copy up"}


def test_overlapping_spans_of_one_thread_go_to_a_second_row(tmp_path):
    # Two reduce-scatters in flight at once and an all-gather inside the second: the viewers draw one thread's
    # events as a stack, so the second collective needs a row of its own.
    spans = [_span("reduce", 0, 0, 2), _span("reduce", 0, 1, 3), _span("all-gather", 0, 2, 2.5)]
    trace = _read(write_trace([spans], tmp_path / "trace.json"))
    threads = _names(trace, "thread_name")
    rows = {}
    for event in _complete(trace):
        rows.setdefault(threads[(event["pid"], event["tid"])], []).append((event["ts"], event["dur"]))
    assert rows == {"collectives": [(0.0, 2000.0), (2000.0, 500.0)], "collectives (2)": [(1000.0, 2000.0)]}


def test_a_span_that_ends_before_it_starts_is_refused(tmp_path):
    with pytest.raises(ValueError, match="ends before it starts"):
        write_trace([[_span("forward", 0, 0, 1), _span("Adam", 0, 3, 2)]], tmp_path / "trace.json")
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a part
    with pytest.raises(ValueError, match="unknown stage 'fwd'"):
        write_trace([[Span("fwd", 0, 0.0, 1.0)]], tmp_path / "trace.json")


def test_no_spans_make_an_empty_but_valid_trace(tmp_path):
    trace = _read(write_trace([[]], tmp_path / "trace.json"))
    assert _complete(trace) == [] and _names(trace, "process_name") == {1: "rank 0"}


def test_a_trace_that_cannot_be_written_names_its_path_and_leaves_nothing(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    target = tmp_path / "a_file" / "trace.json"
    with pytest.raises(OSError, match="could not write the trace .*a_file/trace.json"):
        write_trace([_rank_spans()], target)
    (tmp_path / "trace.json").mkdir()  # the temporary file is written, then cannot replace a directory
    with pytest.raises(OSError, match="could not write the trace .*trace.json"):
        write_trace([_rank_spans()], tmp_path / "trace.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "trace.json"]  # no temporary file left
    assert list((tmp_path / "trace.json").iterdir()) == []


def test_a_real_engine_writes_a_trace_with_its_stages_on_their_threads(tmp_path):
    config = make_config(2, "fp16", offload_optimizer={"device": "cpu"})
    engine = zo.initialize(TinyGPT("nano"), config, accelerator=EmulatedAccelerator())
    for step in range(2):
        x = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        engine.backward(lm_loss(engine(x), x))
        engine.step()
    [spans] = gather_timeline(engine._timeline, engine.comm, trace=tmp_path / "trace.json")
    trace = _read(tmp_path / "trace.json")
    threads = _names(trace, "thread_name")
    events = _complete(trace)
    assert len(events) == len(spans) and min(e["ts"] for e in events) == 0.0
    on = {}
    for event in events:
        on.setdefault(event["name"], set()).add(threads[(event["pid"], event["tid"])])
    assert on["forward"] == on["backward"] == {"device compute"}
    assert on["Adam"] == {"host (CPU Adam)"}
    assert {thread.split(" (")[0] for thread in on["D2H"]} == {"copy down"}  # copies in flight: more rows
    assert {e["args"]["step"] for e in events} == {s.step for s in spans}
    engine.close()


# -- one step of several schedules ---------------------------------------------------------------------------


STEP_STAGES = ("forward", "backward", "Adam")


def _schedule(steps, length_ms):
    """Steps of `length_ms` each, one after the other: forward, backward, Adam."""
    spans = []
    for step in steps:
        t = step * length_ms
        cuts = [t, t + 0.2 * length_ms, t + 0.6 * length_ms, t + length_ms]
        spans += [_span(stage, step, a, b) for stage, a, b in zip(STEP_STAGES, cuts, cuts[1:], strict=False)]
    return spans


def test_the_step_shown_is_the_last_one_every_schedule_has_finished():
    assert step_to_show({"serial": _schedule([0, 1, 2, 3], 4), "overlapped": _schedule([0, 1, 2, 3], 3)}) == 2
    # The last step one schedule holds may be unfinished in another: the step before both is shown.
    assert step_to_show({"serial": _schedule([1, 2, 3, 4], 4), "delayed": _schedule([1, 2, 3], 2)}) == 2
    assert step_to_show({"only": _schedule([5], 4)}) == 5  # a single step: that one
    assert (
        step_to_show({"a": _schedule([1, 2], 4), "b": _schedule([2], 4)}) == 2
    )  # none is followed everywhere
    with pytest.raises(ValueError, match="no optimizer step has spans in every schedule"):
        step_to_show({"a": _schedule([1], 4), "b": _schedule([2], 4)})


def test_plot_step_draws_one_panel_a_schedule_on_one_axis(tmp_path, monkeypatch):
    figures = []
    save = plots.save_figure
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: (figures.append(fig), save(fig, path))[1])
    by_name = {"serial": _schedule([0, 1, 2], 10), "overlapped": _schedule([0, 1, 2], 6)}
    by_name["overlapped"].append(_span("H2D", 1, 9, 9))  # zero length: still drawn, with a sliver of width
    path = plot_step(by_name, tmp_path / "step.png", title="one step")
    assert path.stat().st_size > 10_000
    [fig] = figures
    serial, overlapped = fig.axes
    assert serial.get_title() == "serial: step 1, 10.0 ms"
    assert overlapped.get_title() == "overlapped: step 1, 6.0 ms"
    assert serial.get_xlim() == overlapped.get_xlim() == pytest.approx((0, 10.2))  # shared, the longest's
    assert [t.get_text() for t in overlapped.get_yticklabels()] == ["forward", "backward", "Adam", "H2D"]
    # Bars have their real widths, from the step's first span: backward of the overlapped step is 2.4 ms.
    backward = overlapped.collections[1].get_paths()[0].vertices[:, 0]
    assert (backward.min(), backward.max()) == pytest.approx((1.2, 3.6))
    h2d = overlapped.collections[3].get_paths()[0].vertices[:, 0]
    assert h2d.max() - h2d.min() == pytest.approx(0.002 * 10.0)  # 0.2 % of the axis
    plot_step(by_name, tmp_path / "first.png", step=0, title="the first step")
    assert figures[1].axes[0].get_title() == "serial: step 0, 10.0 ms"
    with pytest.raises(ValueError, match="step 7 has no spans in serial, overlapped"):
        plot_step(by_name, tmp_path / "none.png", step=7, title="no such step")
