"""tools/gpu_check.py, the one prepared GPU smoke test, tried where there is no GPU: without torch or CUDA it
says so and exits 0; --emulated runs every engine check on the emulated device; a failing check fails the run."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu_check.py"
CUDA_ONLY = ("sanitizer", "bandwidth")


def _run(*args: str, code: str | None = None, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code, str(SCRIPT), *args] if code else [sys.executable, str(SCRIPT), *args]
    environ = dict(os.environ, ZO_DEVICE="cpu", **env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=environ)


# Runs the script as __main__ after making a module unimportable, as on a machine that lacks it.
WITHOUT = (
    "import runpy, sys; sys.modules[{name!r}] = None; script = sys.argv[1]; sys.argv = sys.argv[1:]; "
    "runpy.run_path(script, run_name='__main__')"
)


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    proc = _run("--emulated", "--out", str(out))
    return proc, json.loads((out / "results.json").read_text())


def test_without_cuda_it_says_so_in_one_line_and_exits_0():
    proc = _run(CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1 and "no CUDA device" in proc.stdout


def test_without_torch_it_says_so_in_one_line_and_exits_0():
    proc = _run(code=WITHOUT.format(name="torch"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1 and "torch cannot be imported" in proc.stdout


def test_the_emulated_run_passes_every_engine_check_and_skips_the_cuda_ones(emulated):
    proc, results = emulated
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = results["checks"]
    assert results["failed"] == [] and len(checks) == 8
    for name, run in checks["configurations"]["configurations"].items():
        if name == "hf_gpt2" and results["environment"]["transformers"] is None:
            assert run["status"] == "skipped" and "transformers" in run["reason"]
            continue
        assert run["status"] == "passed", (name, run)
        assert len(run["losses"]) == 4 and all(math.isfinite(v) for v in run["losses"]), name
        assert len(run["ms_per_step"]) == 4, name
    assert checks["overlap_equal"]["equal"] is True
    assert checks["dpu_race"]["fp32"]["equal"] is True and checks["dpu_race"]["fp16"]["equal"] is True
    for name in CUDA_ONLY:
        assert checks[name]["status"] == "skipped" and "needs CUDA" in checks[name]["reason"]
    for name in ("overlap_equal", "dpu_race"):
        assert "needs CUDA" in checks[name]["deterministic_kernels"]
    assert checks["oom_hint"]["raised"] and "Hint:" in checks["oom_hint"]["hint"]
    assert checks["oom_hint"]["allocated_after_bytes"] > checks["oom_hint"]["budget_bytes"]
    assert checks["adam_vs_gpu"]["cpu_adam_ms"] > 0
    assert {"serial_ms", "overlapped_ms", "delayed_ms"} <= checks["serial_vs_overlap"].keys()
    env = results["environment"]
    assert env["torch"] == torch.__version__ and env["device"] and env["cpu_model"]


def test_without_cffi_the_emulated_run_falls_back_to_torchs_adam_and_still_passes(tmp_path):
    proc = _run("--emulated", "--out", str(tmp_path), code=WITHOUT.format(name="cffi"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["environment"]["c_kernel"]["available"] is False
    assert results["environment"]["cffi"].startswith("missing") and results["failed"] == []


def test_a_check_that_raises_is_recorded_as_failed_the_others_still_run_and_the_exit_status_is_1(
    tmp_path, monkeypatch
):
    gpu_check = _load_script()
    import gpu_check_runs

    def broken(setup):
        raise RuntimeError("the copy landed late\nsecond line\nthird line")

    monkeypatch.setattr(gpu_check_runs, "check_overlap_equal", broken)
    args = ["--emulated", "--out", str(tmp_path), "--only", "overlap_equal,oom_hint,bandwidth"]
    assert gpu_check.main(args) == 1
    checks = json.loads((tmp_path / "results.json").read_text())["checks"]
    error = checks["overlap_equal"]["error"]
    assert checks["overlap_equal"]["status"] == "failed" and error.startswith(
        "RuntimeError: the copy landed late"
    )
    assert len(error.splitlines()) <= 2
    assert checks["oom_hint"]["status"] == "passed" and checks["bandwidth"]["status"] == "skipped"


def test_weights_that_differ_in_one_bit_fail_the_equality_checks(tmp_path, monkeypatch):
    gpu_check = _load_script()
    import gpu_check_runs

    real_train = gpu_check_runs.train

    def one_bit_off_when_overlapped_or_pinned(setup, config, **kwargs):
        run = real_train(setup, config, **kwargs)
        offload = config["zero_optimization"]["offload_optimizer"]
        if config["zero_offload"].get("overlap_offload") and offload["pin_memory"]:
            weight = run["weights"]["wte.weight"].view(-1)
            weight[0] = torch.nextafter(weight[0], torch.tensor(math.inf))
        return run

    # Serial runs are unchanged; overlapped ones (check 2) and pinned DPU runs (check 3) are one ulp off.
    monkeypatch.setattr(gpu_check_runs, "train", one_bit_off_when_overlapped_or_pinned)
    assert gpu_check.main(["--emulated", "--out", str(tmp_path), "--only", "overlap_equal,dpu_race"]) == 1
    checks = json.loads((tmp_path / "results.json").read_text())["checks"]
    assert (
        checks["overlap_equal"]["status"] == "failed"
        and checks["overlap_equal"]["first_difference"] == "wte.weight"
    )
    assert checks["dpu_race"]["status"] == "failed" and checks["dpu_race"]["fp16"]["equal"] is False


def test_checks_not_started_within_the_budget_are_skipped_with_the_reason(tmp_path):
    gpu_check = _load_script()
    assert gpu_check.main(["--emulated", "--out", str(tmp_path), "--only", "oom_hint", "--budget", "0"]) == 0
    check = json.loads((tmp_path / "results.json").read_text())["checks"]["oom_hint"]
    assert check["status"] == "skipped" and "budget" in check["reason"]


def test_an_unknown_check_name_is_refused_with_the_names_it_knows():
    proc = _run("--emulated", "--only", "bandwith")
    assert proc.returncode == 2 and "bandwidth" in proc.stderr
