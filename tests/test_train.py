"""`zo train` as users run it: one process, torchrun with two ranks, and two loopback "nodes"."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from distributed import free_port

# bf16: no loss scale, so no overflow skip that one rank's half batch could take and the whole batch not.
CONFIG = {
    "train_batch_size": 4,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "overlap_comm": True},
}


def _write_config(tmp_path, config=CONFIG):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return path


def _zo_train(config, out, steps=4, launcher=()):
    """The command line: `zo train ...`, or the same under a torchrun launcher given as its arguments."""
    if launcher:
        prefix = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--master_addr",
            "127.0.0.1",
            *launcher,
            "-m",
        ]
    else:
        prefix = [sys.executable, "-m"]
    args = ["train", "--config", str(config), "--model", "nano", "--steps", str(steps), "--out", str(out)]
    return [*prefix, "zero_offload.cli", *args]


def _summary(out):
    return json.loads((out / "summary.json").read_text())


def test_one_process(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(_zo_train(_write_config(tmp_path), out), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert _summary(out)["world_size"] == 1 and len(_summary(out)["losses"]) == 4
    assert (out / "loss.png").stat().st_size > 0


@pytest.mark.slow
def test_torchrun_two_ranks_matches_one_process(tmp_path):
    config, single, double = _write_config(tmp_path), tmp_path / "single", tmp_path / "double"
    subprocess.run(_zo_train(config, single), check=True, capture_output=True, timeout=300)
    launcher = ("--nproc_per_node", "2", "--master_port", str(free_port()))
    run = subprocess.run(
        _zo_train(config, double, launcher=launcher), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    one, two = _summary(single), _summary(double)
    assert two["world_size"] == 2 and two["traffic_elements"]["reduce_scatter"] > 0
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-3)


@pytest.mark.slow
def test_two_nodes_on_loopback(tmp_path):
    config, out, port = _write_config(tmp_path), tmp_path / "out", str(free_port())
    nodes = [
        subprocess.Popen(
            _zo_train(
                config,
                out,
                steps=3,
                launcher=(
                    "--nnodes",
                    "2",
                    "--node_rank",
                    str(node),
                    "--nproc_per_node",
                    "1",
                    "--master_port",
                    port,
                ),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert _summary(out)["world_size"] == 2


def test_a_bad_config_is_reported_without_a_traceback(tmp_path):
    bad = {"train_batch_size": 4, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    run = subprocess.run(
        _zo_train(_write_config(tmp_path, bad), tmp_path / "out"), capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2 and "offload_param" in run.stderr and "stage 3" in run.stderr
    assert "Traceback" not in run.stderr
