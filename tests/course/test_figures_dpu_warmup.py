"""The DPU warm-up figure draws course/measured/dpu-warmup.json: every setting, its runs, and the json's means."""

from __future__ import annotations

import json
import statistics

import pytest

from tools.figures import dpu_warmup


@pytest.fixture(scope="module")
def data():
    return dpu_warmup.settings()


@pytest.fixture(scope="module")
def result():
    return json.loads(dpu_warmup.SOURCE.read_text(encoding="utf-8"))


def test_every_setting_of_the_json_is_drawn_in_its_order(data, result):
    assert [s.name for s in data] == list(result["summary"])
    assert [s.start_step for s in data] == [None, 0, 10, 40]
    assert len(dpu_warmup.COLORS) >= len(data)  # each setting has its own colour
    for setting in data:
        assert setting.seeds == (0, 1, 2)
        assert all(len(losses) == 300 for losses in setting.losses)


def test_the_plotted_means_are_the_means_of_the_jsons_runs(data, result):
    for setting in data:
        runs = [r for r in result["runs"] if r["start_step"] == setting.start_step]
        assert len(runs) == len(setting.seeds)
        for step in (0, 57, 299):
            assert setting.mean[step] == pytest.approx(statistics.fmean(r["losses"][step] for r in runs))
        # the summary's first-50 mean is the mean of the plotted curve's first 50 steps
        assert statistics.fmean(setting.mean[:50]) == pytest.approx(
            result["summary"][setting.name]["early_mean"]
        )


def test_the_final_validation_losses_are_the_summarys(data, result):
    for setting in data:
        row = result["summary"][setting.name]
        assert list(setting.val_losses) == row["val_loss"]
        assert setting.val_mean == row["val_mean"] == pytest.approx(statistics.fmean(setting.val_losses))
    means = {s.name: round(s.val_mean, 4) for s in data}
    assert means == {
        "no DPU": 2.1623,
        "start_step 0": 3.4588,
        "start_step 10": 3.1712,
        "start_step 40": 2.4681,
    }


def test_before_its_start_step_a_setting_draws_the_same_curve_as_no_dpu(data):
    # steps 0..N run synchronously (the update of step N is the first one delayed): the curves coincide there
    base = data[0]
    for setting in data[1:]:
        n = setting.start_step + 1
        assert setting.mean[:n] == base.mean[:n]
        assert setting.mean[n] != base.mean[n]
