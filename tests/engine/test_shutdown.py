"""The end of a run: engine.close() finishes what is in flight, stops the engine's threads, and leaves the group
it joined; a 2-rank job exits 0 on both ranks, run after run.

Before the engine let gloo finish with its tensors, between one 2-rank run in eight and one in two of the script
below (by configuration) ended with "terminate called without an active exception" and SIGABRT on a rank, after
its last line had run: a gloo worker thread freed a tensor's Python object while the interpreter was shutting
down (principles/comm.py, _Released).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import zero_offload as zo
from tests.support.corpus import fixed_corpus
from tests.support.distributed import free_port
from tests.support.training import BATCH, SEQ, make_config
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss

# One rank of the job: a small model with tied weights, a few steps, and the end a user's script has. GROUP says
# who makes the process group: "engine" (zo.initialize joins the launcher's) or "script" (the script does, and
# destroys it itself, after engine.close()); CLOSE=0 leaves the engine to the exit hook.
SCRIPT = """
import os, sys
import torch, torch.distributed as dist
import zero_offload as zo

stage, offload, group, close = sys.argv[1:5]
if group == "script":
    dist.init_process_group("gloo")

class Tied(torch.nn.Module):
    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.embed, self.mix = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.embed(x))))

torch.manual_seed(0)
zero = {"stage": int(stage)}
if offload == "cpu":
    zero["offload_optimizer"] = {"device": "cpu"}
config = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
engine = zo.initialize(Tied(), config)
batches = torch.Generator().manual_seed(dist.get_rank())
for _ in range(8):
    x = torch.randint(0, 64, (4, 16), generator=batches)
    engine.backward(torch.nn.functional.cross_entropy(engine(x).reshape(-1, 64), x.reshape(-1)))
    engine.step()
if close == "1":
    engine.close()
    assert dist.is_initialized() == (group == "script"), "close() must destroy its own group, and only that"
    if group == "engine" and os.path.isdir("/proc/self/task"):  # and with it gloo's threads (named on Linux)
        names = {open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")}
        assert not names & {"pt_gloo_runloop", "gloo_tcp_loop"}, sorted(names)
if group == "script":
    dist.destroy_process_group()
"""

# (stage, optimizer offload, who makes the group, engine.close() called) in turn: the configurations reported.
JOBS = [("3", "none", "engine", "1"), ("2", "cpu", "engine", "0"), ("3", "none", "script", "1"),
        ("2", "cpu", "script", "0"), ("2", "none", "engine", "1")]  # fmt: skip
REPEATS = 15  # three rounds of JOBS: about 50 s on two idle cores


def _job(script, args: tuple[str, ...]) -> tuple[list[int], str]:
    """Both ranks of one job, started as torchrun starts them (its environment, on loopback); exit codes, output."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "ZO_DIST_TIMEOUT": "60"}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))  # fmt: skip
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            outputs.append(proc.communicate()[0] + "\n(killed after 120 s)")
    return [proc.returncode for proc in procs], "\n".join(outputs)


@pytest.mark.slow
def test_two_rank_jobs_exit_cleanly_run_after_run(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    for run in range(REPEATS):
        args = JOBS[run % len(JOBS)]
        for _attempt in range(3):  # another process may take the free port before rank 0 binds it
            codes, output = _job(script, args)
            if "EADDRINUSE" not in output and "address already in use" not in output.lower():
                break
        assert codes == [0, 0] and "terminate called" not in output, (
            f"run {run} (stage, offload, group, close = {args}): exit codes {codes}\n{output[-3000:]}"
        )


def _config(tmp_path, tier: str) -> dict:
    if tier == "nvme":
        return make_config(2, offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)})
    config = make_config(2, offload_optimizer={"device": "cpu"})
    # Every thread the engine can start: the host queue and the pipeline's two copy streams.
    config["zero_offload"] = {
        "overlap_offload": True,
        "delayed_param_update": {"enabled": True, "start_step": 1},
    }
    return config


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_close_stops_the_engines_threads_and_can_be_called_again(tmp_path, tier):
    before = set(threading.enumerate())
    engine = zo.initialize(
        TinyGPT("nano", seed=0), _config(tmp_path, tier), accelerator=EmulatedAccelerator()
    )
    data = ByteBatches(fixed_corpus(), SEQ, seed=11)
    for step in range(3):
        x, y = data.micro_batch(step, BATCH)
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    started = set(threading.enumerate()) - before
    assert started, "the engine was expected to run work on threads of its own"
    engine.close()
    engine.close()
    assert not started & set(threading.enumerate())
    assert not torch.distributed.is_initialized()  # one process: there was no group to leave
    with pytest.raises(RuntimeError, match=r"engine was closed"):
        engine(x)
