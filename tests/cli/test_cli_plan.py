"""`zo plan` (cli/plan.py): every configuration, the recommendation, the user's own choice, bad input, plots
and calibration, as a user meets them."""

from __future__ import annotations

import pytest
import torch

from zero_offload.cli import main
from zero_offload.tuning import perfmodel

ARGS_13B = ["plan", "--params", "13B", "--gpus", "1", "--gpu-memory", "80GB", "--host-memory", "256GB"]


def test_zo_plan_prints_every_configuration_and_the_recommendation(capsys):
    assert main(ARGS_13B) == 0
    out = capsys.readouterr().out
    for label in ("stage 0 ", "stage 1 + optimizer offload", "stage 3 + optimizer+param offload"):
        assert label in out
    assert "no: device" in out and "no: host" in out and "260.0 GB" in out
    assert "Recommendation: stage 2 + optimizer offload (ratio 0.8)" in out and '"ratio": 0.8' in out
    assert "[host-memory]" in out and "16.0 bytes a parameter" in out


def test_zo_plan_checks_the_users_own_choice(capsys):
    assert main(["plan", "--params", "1B", "--gpus", "1", "--stage", "2", "--offload", "optimizer"]) == 0
    assert "Your choice, stage 2 + optimizer offload: fits" in capsys.readouterr().out
    assert main([*ARGS_13B, "--stage", "2", "--offload", "optimizer+param"]) == 2
    assert "needs ZeRO stage 3" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [(["--gpus", "0"], "--gpus must be at least 1 (--gpus 1 for a single GPU)"),
     (["--batch", "0"], "--batch must be at least 1"), (["--link", "-3"], "--link must be more than 0"),
     (["--mfu", "1.5"], "--mfu is a share")],
)  # fmt: skip
def test_zo_plan_rejects_bad_numbers_and_says_what_is_expected(capsys, extra, message):
    assert main([*ARGS_13B, *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [(["--gpu-memory", "80XB"], "cannot read '80XB' as a byte size"),
                                            (["--params", "lots"], "cannot read 'LOTS' as a parameter count")])  # fmt: skip
def test_zo_plan_rejects_unreadable_sizes(capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        main([*ARGS_13B, *extra])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_zo_plan_saves_plots_of_step_time(tmp_path, capsys):
    assert main([*ARGS_13B, "--plot", str(tmp_path)]) == 0
    for name in ("step_time_vs_batch.png", "step_time_vs_link.png"):
        assert (tmp_path / name).stat().st_size > 10_000


def test_zo_plan_calibrate_keeps_the_presets_capacities(capsys, monkeypatch):
    quick = perfmodel.calibrate
    monkeypatch.setattr(
        perfmodel, "calibrate", lambda base, **kw: quick(base, **kw, numel=1 << 18, repeats=1)
    )
    assert main(["plan", "--params", "13B", "--preset", "a100-80g", "--calibrate", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "a100-80g+calibrated: 8 GPU(s) of 85.9 GB" in out and "host 2199.0 GB, 128 cores" in out
    assert "stage 2 + optimizer offload            35.2 GB  260.0 GB  yes" in out  # 13B fits in 2 TiB


def test_zo_plan_calibrated_on_this_machine(capsys):
    args = ["plan", "--params", "10M", "--preset", "this-cpu", "--threads", "1", "--precision", "fp32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "this-cpu: 1 GPU(s)" in out or torch.cuda.is_available()
    assert "Recommendation:" in out
