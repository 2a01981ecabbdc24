"""The measured schedule-step figure draws the lesson's stored phase medians, and nothing else."""

from __future__ import annotations

import pytest

from tools.figures import schedules


def test_the_phase_medians_are_the_notebooks_split_cores_table():
    medians = schedules.phase_medians()
    assert list(medians) == ["serial", "overlapped", "delayed (DPU)"]
    assert medians["serial"] == {"step": 41.7, "forward": 7.8, "backward": 20.8, "adam": 8.6, "tail": 11.9}
    assert medians["overlapped"]["backward"] == 27.9 and medians["overlapped"]["adam"] == 15.3
    assert medians["delayed (DPU)"]["tail"] == 1.1


def test_each_step_stacks_its_phases_on_the_device_and_places_adam_beside_what_it_ran_with():
    medians = schedules.phase_medians()
    serial = schedules.step_bars(medians["serial"], "serial")
    assert serial["device"] == [
        ("forward", 0.0, 7.8),
        ("backward", 7.8, 20.8),
        ("tail (device waits)", pytest.approx(28.6), 11.9),
    ]
    assert serial["host"] == [("Adam (busy)", pytest.approx(28.6), 8.6)]  # after backward
    assert schedules.step_bars(medians["overlapped"], "overlapped")["host"] == [("Adam (busy)", 6.7, 15.3)]
    assert schedules.step_bars(medians["delayed (DPU)"], "delayed (DPU)")["host"] == [
        ("Adam (busy)", 0.0, 8.3)
    ]


def test_a_notebook_without_the_table_is_refused(tmp_path):
    empty = tmp_path / "empty.ipynb"
    empty.write_text('{"cells": []}', encoding="utf-8")
    with pytest.raises(ValueError, match="expected one split-cores phase table, found 0"):
        schedules.phase_medians(empty)
