"""The `zo` command: estimates, config checks and the demo, as a user meets them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zero_offload.cli import main
from zero_offload.cli.arguments import parse_count
from zero_offload.cli.demo.run import run_demo


def test_estimate_13b(capsys):
    assert main(["estimate", "13B"]) == 0
    out = capsys.readouterr().out
    assert "208.0 GB" in out and "master_weights" in out


def test_estimate_with_offload(capsys):
    assert main(["estimate", "13B", "--stage", "2", "--offload-optimizer", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "device 26.0 GB, host 208.0 GB" in out


def test_estimate_with_int8_moments_counts_a_byte_each_and_the_block_scales(capsys):
    assert main(["estimate", "13B", "--stage", "2", "--offload-optimizer", "cpu", "--moments", "int8"]) == 0
    out = capsys.readouterr().out
    # fp32 gradients 4 + master 4 + m and v 1 each + a 4-byte scale per 2048 of each: 130.1 GB, not 208.0.
    host = 13e9 * 10 + 2 * 4 * -(-13e9 // 2048)
    assert "int8 moments" in out and f"host {host / 1e9:.1f} GB" in out


def test_estimate_rejects_an_impossible_combination(capsys):
    assert main(["estimate", "1B", "--stage", "2", "--offload-param", "cpu"]) == 2
    assert "stage 3" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, value", [("13B", 13 * 10**9), ("350M", 350 * 10**6), ("1.5e9", 1_500_000_000)]
)
def test_parameter_counts(text, value):
    assert parse_count(text) == value


def test_check_config_reports_the_key_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stagee": 2}}))
    run = subprocess.run(
        [sys.executable, "-m", "zero_offload.cli", "check-config", str(bad)], capture_output=True, text=True
    )
    assert run.returncode == 2
    assert "zero_optimization.stagee" in run.stderr and "did you mean 'stage'" in run.stderr
    assert "Traceback" not in run.stderr


def test_check_config_prints_the_full_config(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"train_batch_size": 8, "fp16": {"enabled": True}}))
    assert main(["check-config", str(good), "--world-size", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["train_micro_batch_size_per_gpu"] == 4 and printed["fp16"]["loss_scale_window"] == 1000


def test_grading_an_unknown_lab_fails_cleanly(capsys):
    assert main(["grade", "9"]) == 2


def test_demo_runs_end_to_end_on_two_ranks_and_writes_its_report(tmp_path):
    # --quick: the same five parts with a 0.8M-parameter model under a 10 MiB device.
    report = run_demo(tmp_path, ranks=2, quick=True, steps=4)
    text = report.read_text()
    assert "208.0 GB" in text and "offload_param" in text and "out of memory" in text
    results = json.loads((tmp_path / "results.json").read_text())
    offload = results["offload"]  # the model stage 0 could not hold trains in the same budget, on 2 ranks
    assert offload["ranks"] == 2 and offload["device_peak"] <= offload["budget"]
    assert offload["pcie_bytes_per_step"]["d2h"] == offload["pcie_bytes_per_step"]["h2d"] > 0
    memory = results["memory"]
    assert memory["stage 0"] == {"out_of_memory": True}
    assert memory["ZeRO-2 + NVMe offload"]["nvme"] > 0 and memory["ZeRO-2 + CPU offload"]["nvme"] == 0
    assert memory["ZeRO-3 + CPU offload (params too)"]["device"] < memory["ZeRO-2 + CPU offload"]["device"]
    assert set(results["schedules"]) <= {"split", "shared"} and results["schedules"]
    largest = results["largest"]
    assert largest["with"]["params"] > 10 * largest["without"]["params"]
    # The offloaded run keeps 8-bit moments on the host; the same host's bytes a parameter, fp32 against int8.
    assert largest["with"]["moments"] == "int8" and largest["with"]["optimizer_bytes_per_param"] < 6.1
    capacity = largest["host_capacity"]
    assert capacity["fp32"]["optimizer_bytes_per_param"] == 12.0
    assert capacity["fp32"]["host_bytes_per_param"] - capacity["int8"]["host_bytes_per_param"] > 5.9
    assert capacity["more_params"] > 1 and "What the 8-bit moments buy" in text
    for plot in ("memory_13b.png", "loss.png", "memory_per_tier.png", "timeline_overlapped_shared.png"):
        assert (tmp_path / plot).stat().st_size > 10_000


def test_the_largest_model_needs_less_host_with_8_bit_moments_and_falls_back_without_a_compiler(monkeypatch):
    from zero_offload.cli.bench import largest
    from zero_offload.tuning.build import CPUAdamUnavailable

    assert largest.host_bytes_needed("1b", "int8") < largest.host_bytes_needed("1b", "fp32")
    config = largest._config(largest.gpt_config("nano"), True, 2**20, "int8")
    assert config["zero_offload"]["cpu_adam"]["states"] == "int8"

    def no_compiler():
        raise CPUAdamUnavailable("no C compiler")

    monkeypatch.setattr(largest, "build", no_compiler)
    assert largest.offload_moments() == "fp32"  # the demo still runs, with fp32 moments, and says so
