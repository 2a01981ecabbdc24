"""The demo's report explains each ratio it prints from the measured values, and its timelines show one step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zero_offload.cli.demo.explain import explain_schedules
from zero_offload.cli.demo.report import write_report
from zero_offload.practice.spans import Span
from zero_offload.practice.timeline_plots import representative_step

MEASURED = Path(__file__).resolve().parents[2] / "course" / "measured" / "bench-schedules-amd-epyc-zen5.json"


def _measured(row: str) -> dict:
    return json.loads(MEASURED.read_text(encoding="utf-8"))["schedules"][row]


def _result(cores: str, *, serial_over_overlapped: float, device: tuple[float, float, float]) -> dict:
    """A compare_schedules result: `device` is the device's CPU ms a step for serial, overlapped and DPU."""
    names = ("serial", "overlapped", "delayed (DPU)")
    busy = {n: {"device": d, "host": 20.0, "waited": 1.0} for n, d in zip(names, device, strict=True)}
    return {
        "cores": cores,
        "median_ms": dict.fromkeys(names, 50.0),
        "mean_ms": dict.fromkeys(names, 50.0),
        "busy_ms": busy,
        "bound_ms": {n: max(d, 20.0) for n, d in zip(names, device, strict=True)},
        "of_bound": {n: 50.0 / max(d, 20.0) for n, d in zip(names, device, strict=True)},
        "overlapped_vs_serial": serial_over_overlapped,
        "delayed_vs_overlapped": 1.0,
    }


def test_a_measured_run_where_both_schedules_gain_is_explained_by_what_they_hid():
    r = _measured("split, 4 slots, batch 1 x 8, widest C Adam")
    overlap, dpu, bound = explain_schedules(r)
    assert overlap.startswith("Overlapped was 1.10x as fast as serial")
    assert "tail after backward was hidden" in overlap
    assert dpu.startswith("DPU was 1.16x as fast as overlapped") and "next step's forward" in dpu
    # 1.14x its bound of 31.3 ms: the rest is the device's thread blocked (2.4 ms) or off its core.
    assert bound.startswith("DPU's step took 1.14x its bound, 31.3 ms") and "blocked 2.4 ms" in bound


def test_an_overlapped_step_slower_than_serial_on_shared_cores_names_the_contention():
    r = _result("shared", serial_over_overlapped=0.93, device=(30.0, 36.0, 36.0))
    overlap, dpu, _ = explain_schedules(r)
    assert overlap.startswith("Overlapped was slower: it took 1.08x as long as serial")
    assert "from 30.0 to 36.0 ms" in overlap and "the same cores and memory bandwidth" in overlap
    assert "hidden" not in overlap.split(":")[0]
    assert dpu.startswith("DPU was 1.00x as fast as overlapped") and "Both sides were busy" in dpu


def test_no_gain_without_contention_says_there_was_little_to_hide():
    r = _result("split", serial_over_overlapped=1.01, device=(30.0, 30.5, 30.0))
    overlap, dpu, bound = explain_schedules(r)
    assert "little to hide" in overlap and "20.0 against 30.0 ms" in overlap
    assert "already shorter than the device's" in dpu
    assert bound.startswith("DPU's step took 1.67x its bound, 30.0 ms")


def test_the_report_prints_the_explanations_under_each_table(tmp_path):
    r = _measured("shared, 4 slots, batch 1 x 8, widest C Adam")
    results = {
        "arithmetic": {"estimates": {}, "introduction": ""},
        "out_of_memory": "",
        "offload": {
            "params": 1,
            "ranks": 1,
            "nodes": 1,
            "steps": 1,
            "losses": [1.0],
            "device_peak": 1,
            "budget": 2,
            "pcie_bytes_per_step": {"d2h": 1, "h2d": 1},
        },
        "memory": {},
        "schedules": {"shared": r},
    }
    text = write_report(tmp_path, results).read_text(encoding="utf-8")
    assert (
        "- Overlapped was 1.05x as fast as serial" in text and "- DPU was 1.09x as fast as overlapped" in text
    )


def _steps(lengths: dict[int, float], gap: float = 1.0) -> list[Span]:
    """Steps one after another (with `gap` seconds between them), each a forward then a backward."""
    spans, t = [], 100.0
    for step, length in lengths.items():
        spans += [
            Span("forward", step, t, t + length / 2),
            Span("backward", step, t + length / 2, t + length),
        ]
        t += length + gap
    return spans


def test_the_step_shown_is_the_median_length_one_after_the_first():
    # Step 0 is warm-up and step 5 may be unfinished: of 1-4 (0.04, 0.5 after a pause, 0.03, 0.05 s) the median
    # is 0.04 (the shorter middle one of four).
    spans = _steps({0: 0.9, 1: 0.04, 2: 0.5, 3: 0.03, 4: 0.05, 5: 0.01})
    assert representative_step(spans) == 1


def test_with_one_or_two_steps_the_shorter_is_shown_and_an_empty_timeline_is_refused():
    assert representative_step(_steps({7: 0.2})) == 7
    assert representative_step(_steps({7: 0.2, 8: 0.1})) == 8
    with pytest.raises(ValueError, match="no spans"):
        representative_step([])


def test_the_cause_named_is_what_grew_most_on_the_devices_thread():
    r = _result("split", serial_over_overlapped=0.8, device=(30.0, 30.0, 30.0))
    r["busy_ms"]["overlapped"]["waited"] = 9.0  # blocked 8 ms more than serial: the host fell behind
    assert "blocked 9.0 ms a step (against 1.0 in serial)" in explain_schedules(r)[0]
    r = _result("shared", serial_over_overlapped=0.8, device=(30.0, 30.0, 30.0))
    r["mean_ms"]["overlapped"] = 60.0  # 10 ms more off its core, neither more work nor more waits
    overlap = explain_schedules(r)[0]
    assert "spent 10.0 ms a step more able to run but not running" in overlap and "GIL" in overlap
