"""The moment-convergence figure draws course/measured/moment-convergence.json: every workload and precision, the
json's mean of seeds, and the summary's final validation losses in the legend."""

from __future__ import annotations

import json
import statistics

import pytest

from tools.figures import moment_convergence


@pytest.fixture(scope="module")
def result():
    return json.loads(moment_convergence.SOURCE.read_text(encoding="utf-8"))


def test_every_workload_and_precision_has_a_curve_of_its_steps(result):
    assert list(result["summary"]) == ["tinygpt", "tinygpt-fp16", "llama"]
    for workload in result["summary"]:
        steps = next(r["steps"] for r in result["runs"] if r["workload"] == workload)
        for precision in moment_convergence.PRECISIONS:
            assert len(moment_convergence.smoothed_means(result, workload, precision)) == steps


def test_the_curve_is_the_trailing_average_of_the_mean_of_seeds(result):
    runs = [r for r in result["runs"] if r["workload"] == "llama" and r["precision"] == "int8"]
    assert len(runs) == 3
    mean = [statistics.fmean(r["losses"][i] for r in runs) for i in range(len(runs[0]["losses"]))]
    smooth = moment_convergence.smoothed_means(result, "llama", "int8")
    assert smooth[0] == pytest.approx(mean[0])  # the window holds one step at the start
    assert smooth[-1] == pytest.approx(statistics.fmean(mean[-moment_convergence.WINDOW :]))


def test_the_legends_final_losses_are_the_summarys(result):
    vals = {w: round(result["summary"][w]["fp32"]["val_mean"], 4) for w in result["summary"]}
    assert vals == {"tinygpt": 1.9484, "tinygpt-fp16": 1.9605, "llama": 2.0432}  # chapter 4's table
