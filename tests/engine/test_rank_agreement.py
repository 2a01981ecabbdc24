"""Ranks that were started differently stop before they train, on every rank, naming what differs.

Without the checks, another --seed on one rank trained on other data silently, another --out left a checkpoint
without that rank's file, another --model made gloo abort a rank and another --steps waited for the timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import zero_offload as zo
from tests.support.distributed import check, free_port, run_ranks
from zero_offload.workloads import TinyGPT, gpt_config

CONFIG = {"train_batch_size": 4, "zero_optimization": {"stage": 2}}


def _train_rank(rank, world_size, config_path, out, rank1_changes):
    from zero_offload.cli.train.trainer import TrainError, train

    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank))  # what torchrun would set
    options = dict(model="nano", steps=1, out=out, seed=0)
    if rank == 1:
        options.update(rank1_changes)
    try:
        train(config_path, **options)
    except TrainError as err:
        return str(err)
    return "trained"


@pytest.mark.parametrize(
    "changes, flag",
    [({"seed": 1}, "--seed"), ({"out": "elsewhere"}, "--out"), ({"model": "tiny"}, "--model"),
     ({"steps": 2}, "--steps")],
)  # fmt: skip
def test_zo_train_refuses_ranks_started_with_different_arguments(tmp_path, changes, flag):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(CONFIG))
    results = check(run_ranks(_train_rank, 2, str(config), str(tmp_path / "out"), changes))
    for message in results:  # every rank refuses, with the same message
        assert message == results[0]
        assert f"the ranks were started with different {flag} (rank 0: " in message
    assert not (tmp_path / "out").exists()  # refused before anything was written


def _initialize_rank(rank, world_size, d_model):
    model = TinyGPT(gpt_config("nano", d_model=d_model if rank == 1 else 64))
    try:
        zo.initialize(model, CONFIG)
    except ValueError as err:
        return str(err)
    return "initialized"


def test_a_model_that_differs_by_rank_is_refused_naming_the_first_different_parameter():
    results = check(run_ranks(_initialize_rank, 2, 32))  # rank 1's model is narrower
    assert results[0] == results[1]
    message = results[0]
    assert (
        "the ranks train different models: trainable parameter 0 is wte.weight of shape (256, 64) on "
        in message
    )
    assert "rank 0 but wte.weight of shape (256, 32) on rank 1" in message
    assert "build the same model on every rank" in message


@pytest.mark.slow
def test_under_torchrun_every_rank_exits_with_one_line_naming_the_option(tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(CONFIG))
    port, logs = free_port(), [tmp_path / f"node{node}.log" for node in (0, 1)]
    nodes = []
    for node in (0, 1):  # one rank a node, as two machines would be started by hand
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                   "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                   "-m", "zero_offload.cli", "train", "--config", str(config), "--model", "nano", "--steps", "2",
                   "--out", str(tmp_path / "out"), "--seed", str(node)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        nodes.append(
            subprocess.Popen(command, stdout=logs[node].open("w"), stderr=subprocess.STDOUT, env=env)
        )
    try:
        for proc in nodes:
            proc.wait(timeout=120)
    finally:
        for proc in nodes:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, log in zip(nodes, logs, strict=True):
        text = log.read_text()
        assert proc.returncode != 0
        errors = [line for line in text.splitlines() if line.startswith("error: ")]
        assert errors == ["error: the ranks were started with different --seed (rank 0: 0, rank 1: 1); start "
                          "every rank with the same command line, e.g. the same --seed 0"], text  # fmt: skip
        assert "exitcode  : 2" in text and "SIGABRT" not in text and "terminate called" not in text, text
