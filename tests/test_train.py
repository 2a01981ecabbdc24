"""`zo train` as users run it: one process, torchrun with two ranks, and two loopback "nodes"."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from distributed import free_port

CONFIG = {
    "train_batch_size": 4,
    "fp16": {"enabled": True, "initial_scale_power": 10},
    "zero_optimization": {"stage": 2, "overlap_comm": True},
}


def _write_config(tmp_path, config=CONFIG):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return path


def _torchrun(*args):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--master_addr",
        "127.0.0.1",
        *args,
        "-m",
        "zero_offload.cli",
    ]


def test_one_process(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "zero_offload.cli",
            "train",
            "--config",
            str(_write_config(tmp_path)),
            "--model",
            "nano",
            "--steps",
            "4",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 1 and len(summary["losses"]) == 4
    assert (out / "loss.png").stat().st_size > 0


@pytest.mark.slow
def test_torchrun_two_ranks_matches_one_process(tmp_path):
    config = _write_config(tmp_path)
    single, double = tmp_path / "single", tmp_path / "double"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "zero_offload.cli",
            "train",
            "--config",
            str(config),
            "--model",
            "nano",
            "--steps",
            "4",
            "--out",
            str(single),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    run = subprocess.run(
        [
            *_torchrun("--nproc_per_node", "2", "--master_port", str(free_port())),
            "train",
            "--config",
            str(config),
            "--model",
            "nano",
            "--steps",
            "4",
            "--out",
            str(double),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    one, two = (json.loads((d / "summary.json").read_text()) for d in (single, double))
    assert two["world_size"] == 2 and two["traffic_elements"]["reduce_scatter"] > 0
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-3)


@pytest.mark.slow
def test_two_nodes_on_loopback(tmp_path):
    config, out, port = _write_config(tmp_path), tmp_path / "out", str(free_port())
    nodes = [
        subprocess.Popen(
            [
                *_torchrun(
                    "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1", "--master_port", port
                ),
                "train",
                "--config",
                str(config),
                "--model",
                "nano",
                "--steps",
                "3",
                "--out",
                str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2


def test_a_bad_config_is_reported_without_a_traceback(tmp_path):
    bad = _write_config(
        tmp_path,
        {"train_batch_size": 4, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
    )
    run = subprocess.run(
        [sys.executable, "-m", "zero_offload.cli", "train", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "offload_param" in run.stderr and "stage 3" in run.stderr
    assert "Traceback" not in run.stderr
