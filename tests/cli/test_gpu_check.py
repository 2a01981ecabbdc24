"""tools/gpu_check/ (`python -m tools.gpu_check`), the one prepared GPU smoke test, tried where there is no GPU: without torch or CUDA it
says so and exits 0; --emulated runs every engine check on the emulated device; a failing check fails the run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools import gpu_check
from tools.gpu_check import configs as gpu_check_configs
from tools.gpu_check import dist as gpu_check_dist
from tools.gpu_check import runs as gpu_check_runs

ROOT = Path(__file__).resolve().parents[2]
CUDA_ONLY = ("sanitizer", "bandwidth")


def _run(*args: str, code: str | None = None, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "tools.gpu_check", *args]
    environ = dict(os.environ, ZO_DEVICE="cpu", **env)
    # From the repository root, as `make gpu-check` runs it: the package tools is found there.
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=environ, cwd=ROOT)


# Runs the package as `python -m` would, after making a module unimportable, as on a machine that lacks it.
WITHOUT = (
    "import runpy, sys; sys.modules[{name!r}] = None; "
    "runpy.run_module('tools.gpu_check', run_name='__main__', alter_sys=True)"
)


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
    assert results["failed"] == [] and len(checks) == 11
    for name, run in checks["configurations"]["configurations"].items():
        if name == "hf_gpt2" and results["environment"]["transformers"] is None:
            assert run["status"] == "skipped" and "transformers" in run["reason"]
            continue
        assert run["status"] == "passed", (name, run)
        assert run["relative_error"] <= run["tolerance"] < 1, name  # never uploading scores 1
        assert run["reference"].startswith("stage0") and len(run["losses"]) == 4, name
    assert checks["overlap_equal"]["equal"] is True
    assert checks["overlap_equal"]["reduce_bucket_size"] < 100_000  # about one unit of the nano model
    for precision in ("fp32", "fp16"):
        race = checks["dpu_race"][precision]
        assert race["equal"] is True and race["control_without_wait_differs"] is True, precision
    for name in CUDA_ONLY:
        assert checks[name]["status"] == "skipped" and "needs CUDA" in checks[name]["reason"]
    for name in ("overlap_equal", "dpu_race"):
        assert "needs CUDA" in checks[name]["deterministic_kernels"]
    assert checks["oom_hint"]["raised"] and "Hint:" in checks["oom_hint"]["hint"]
    assert checks["oom_hint"]["allocated_after_bytes"] > checks["oom_hint"]["budget_bytes"]
    assert "LOCAL_RANK=0" in checks["one_gpu_per_rank"]["message"]
    assert all(checks["torch_api"]["found"].values())
    assert checks["two_ranks"]["backend"] == "gloo" and checks["two_ranks"]["ranks_equal"] is True
    assert checks["adam_vs_gpu"]["status"] == "reported" and checks["adam_vs_gpu"]["cpu_adam_ms"] > 0
    assert {"serial_ms", "overlapped_ms", "delayed_ms"} <= checks["serial_vs_overlap"].keys()
    assert "reported, not checked" in proc.stdout
    env = results["environment"]
    assert env["torch"] == torch.__version__ and env["device"] and env["cpu_model"]


def test_without_cffi_the_emulated_run_falls_back_to_torchs_adam_and_still_passes(tmp_path):
    only = "configurations,overlap_equal,dpu_race"  # the checks that run the host's Adam
    proc = _run("--emulated", "--out", str(tmp_path), "--only", only, code=WITHOUT.format(name="cffi"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["environment"]["c_kernel"]["available"] is False
    assert results["environment"]["cffi"].startswith("missing") and results["failed"] == []
    # torch's Adam rounds nothing into the buffer the fp16 upload reads: no race to find, and it says so.
    race = results["checks"]["dpu_race"]
    assert race["fp32"]["adam"] == "torch" and race["fp16"]["reason"] == "skipped: no cffi"


def test_a_check_that_raises_is_recorded_as_failed_the_others_still_run_and_the_exit_status_is_1(
    tmp_path, monkeypatch
):
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


def test_weights_that_differ_in_one_bit_fail_the_equality_check(tmp_path, monkeypatch):
    real_train = gpu_check_runs.train

    def one_bit_off_when_overlapped(setup, config, **kwargs):
        run = real_train(setup, config, **kwargs)
        if config["zero_offload"].get("overlap_offload"):
            weight = run["weights"]["wte.weight"].view(-1)
            weight[0] = torch.nextafter(weight[0], torch.tensor(math.inf))
        return run

    monkeypatch.setattr(gpu_check_runs, "train", one_bit_off_when_overlapped)
    assert gpu_check.main(["--emulated", "--out", str(tmp_path), "--only", "overlap_equal"]) == 1
    check = json.loads((tmp_path / "results.json").read_text())["checks"]["overlap_equal"]
    assert check["status"] == "failed" and check["first_difference"] == "wte.weight"


def test_an_engine_that_never_uploads_its_new_weights_fails_configurations(tmp_path, monkeypatch):
    from zero_offload.implementation.transfers import Transfers

    # The serial step's publish, the pipeline's uploads, and the delayed update's (during the next backward).
    chosen = ("stage2_offload_pinned", "stage2_offload_overlap", "stage2_offload_dpu")
    every = gpu_check_configs.configurations
    monkeypatch.setattr(gpu_check_configs, "configurations", lambda s: {n: every(s)[n] for n in chosen})
    monkeypatch.setattr(Transfers, "to_device", lambda self, dst, src, blocking=False: None)
    assert gpu_check.main(["--emulated", "--out", str(tmp_path), "--only", "configurations"]) == 1
    runs = json.loads((tmp_path / "results.json").read_text())["checks"]["configurations"]["configurations"]
    for name in chosen:
        assert runs[name]["status"] == "failed" and runs[name]["relative_error"] > 0.9, (name, runs[name])
        assert "tolerance" in runs[name]["reason"], name


def test_a_delayed_update_that_does_not_wait_for_its_uploads_fails_dpu_race(tmp_path, monkeypatch):
    from zero_offload.practice.dpu import DelayedUpdate

    finish = DelayedUpdate.finish

    def finish_forgetting_uploads(self, publish):  # the next Adam then starts while the uploads still read
        published = finish(self, publish)
        self.uploads = None
        return published

    monkeypatch.setattr(DelayedUpdate, "finish", finish_forgetting_uploads)
    assert gpu_check.main(["--emulated", "--out", str(tmp_path), "--only", "dpu_race"]) == 1
    check = json.loads((tmp_path / "results.json").read_text())["checks"]["dpu_race"]
    assert check["status"] == "failed" and check["fp32"]["equal"] is False
    assert DelayedUpdate.finish is finish_forgetting_uploads  # the check put back what it found


@pytest.mark.parametrize(
    ("name", "result", "emulated", "counts_as"),
    [
        ("sanitizer", {"status": "skipped", "reason": "skipped: needs CUDA"}, True, "skipped"),
        (
            "sanitizer",
            {"status": "skipped", "reason": "skipped: the run's budget", "budget_spent": True},
            False,
            "failed",
        ),  # fmt: skip
        ("sanitizer", {"status": "skipped", "reason": "skipped: whatever the reason"}, False, "failed"),
        (
            "configurations",
            {"status": "skipped", "reason": "skipped: budget", "budget_spent": True},
            False,
            "failed",
        ),  # fmt: skip
        (
            "bandwidth",
            {"status": "skipped", "reason": "skipped: budget", "budget_spent": True},
            False,
            "skipped",
        ),
        (
            "two_ranks",
            {"status": "skipped", "reason": "skipped: needs 2 GPUs, this machine has 1"},
            False,
            "skipped",
        ),  # fmt: skip
        ("sanitizer", {"status": "passed"}, False, "passed"),
    ],
)
def test_on_cuda_a_skipped_sanitizer_fails_and_so_does_a_check_the_budget_left_out(
    name, result, emulated, counts_as
):
    assert gpu_check.verdict(name, result, emulated=emulated)["status"] == counts_as


def test_the_torch_api_check_names_the_older_collectives_and_fails_without_any(monkeypatch):
    import torch.distributed as dist

    for name in ("reduce_scatter_single", "all_gather_single"):  # as in torch 2.1 to 2.12
        monkeypatch.delattr(dist, name, raising=False)
    older = gpu_check_dist.check_torch_api(None)
    assert older["found"] == {
        "reduce_scatter": ["reduce_scatter_tensor"],
        "all_gather": ["all_gather_into_tensor"],
    }
    assert older["problems"] == []
    monkeypatch.delattr(dist, "all_gather_into_tensor")
    assert "all_gather_single / all_gather_into_tensor" in gpu_check_dist.check_torch_api(None)["problems"][0]


def test_checks_not_started_within_the_budget_are_skipped_with_the_reason(tmp_path):
    assert gpu_check.main(["--emulated", "--out", str(tmp_path), "--only", "oom_hint", "--budget", "0"]) == 0
    check = json.loads((tmp_path / "results.json").read_text())["checks"]["oom_hint"]
    assert check["status"] == "skipped" and "budget" in check["reason"]


def test_an_unknown_check_name_is_refused_with_the_names_it_knows():
    proc = _run("--emulated", "--only", "bandwith")
    assert proc.returncode == 2 and "bandwidth" in proc.stderr
