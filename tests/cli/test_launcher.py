"""A user's own script under torchrun: `zo.initialize` joins the group the launcher describes, as
`deepspeed.initialize` does, and the two ranks train as one job (not as two jobs of one rank)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.support.distributed import free_port, run_ranks

# The README's loop, as a user would write it: no init_process_group anywhere. Each rank reads its half of
# every global batch; fp32, AdamW with a large eps and no clipping, so that summed instead of averaged gradients
# would change the weights (Adam hides a constant factor on the gradient when eps is small).
SCRIPT = textwrap.dedent(
    """
    import sys, torch, zero_offload as zo
    from zero_offload.workloads import TinyGPT, ByteBatches, load_corpus, lm_loss

    torch.manual_seed(0)
    model = TinyGPT("nano")
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    engine = zo.initialize(model, {
        "train_micro_batch_size_per_gpu": 8 // world,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "eps": 1e-3, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 2},
    })
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    data = ByteBatches(load_corpus(), model.cfg.seq_len)
    losses = []
    for step in range(4):
        x, y = data.micro_batch(step, 8 // world, rank=rank, world_size=world)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if rank == 0:
        torch.save({"world_size": engine.comm.world_size, "losses": losses,
                    "grad_norms": [r["grad_norm"] for r in engine.history],
                    "weights": {n: p.detach().float().clone() for n, p in model.named_parameters()}},
                   sys.argv[1])
    """
)


def _run(script, out, nproc: int | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZO_DEVICE": "cpu"}
    if nproc is None:
        command = [sys.executable, str(script), str(out)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), str(out)]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.slow
def test_a_bare_script_under_torchrun_trains_at_world_size_2_and_equals_one_process(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    for out, nproc in ((one, None), (two, 2)):
        run = _run(script, out, nproc)
        assert run.returncode == 0, run.stderr[-3000:]
    one, two = torch.load(one, weights_only=True), torch.load(two, weights_only=True)
    assert (one["world_size"], two["world_size"]) == (1, 2)
    # Rank 0's loss is on its half of the batch; the gradient norm is of the averaged gradient, the whole batch's.
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
    for name, weight in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], weight, rtol=1e-5, atol=1e-6, msg=name)


def _join_with_env(rank, world_size, env):
    from zero_offload.principles.process_group import join_launcher_group

    os.environ.update(env)
    try:
        join_launcher_group()
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize(
    "env, named",
    [({"WORLD_SIZE": "4"}, ["WORLD_SIZE=4", "has 2 ranks"]), ({"WORLD_SIZE": "2", "RANK": "7"}, ["RANK=7"])],
)
def test_an_environment_that_disagrees_with_an_existing_group_is_refused_naming_both(env, named):
    errors = run_ranks(_join_with_env, 2, env)
    for error in errors:
        assert error is not None and all(word in error for word in named), error


def test_an_existing_group_that_agrees_is_used_as_it_is():
    assert run_ranks(_join_with_env, 2, {"WORLD_SIZE": "2"}) == [None, None]


def test_no_launcher_means_one_process_and_a_bad_world_size_is_named(monkeypatch):
    from zero_offload.principles.process_group import join_launcher_group

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert join_launcher_group() is False and not torch.distributed.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        join_launcher_group()


@pytest.mark.slow
def test_a_bad_config_under_torchrun_fails_on_every_rank_with_its_message_and_a_clean_exit(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(
        "import torch, zero_offload as zo\n"
        "zo.initialize(torch.nn.Linear(2, 2), {'train_micro_batch_size_per_gpu': 1, 'zero_optimisation': {}})\n"
    )
    run = _run(script, tmp_path / "unused.pt", 2)
    assert run.returncode != 0
    assert run.stderr.count("zero_optimisation") >= 2, run.stderr[-3000:]  # both ranks name the key
    assert "terminate called" not in run.stderr and "SIGABRT" not in run.stderr, run.stderr[-3000:]


def test_the_backend_follows_the_accelerator_even_where_a_gpu_is_visible(monkeypatch):
    from zero_offload.accelerator import wants_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("ZO_DEVICE", "cpu")  # the emulated device on a GPU machine: gloo, CPU tensors
    assert wants_cuda() is False
    monkeypatch.delenv("ZO_DEVICE")
    assert wants_cuda() is True


def test_more_ranks_on_a_node_than_gpus_is_refused_with_the_fix(monkeypatch):
    from zero_offload.accelerator.cuda import gpu_of_this_rank

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=1 but this node has 1 GPU.*ZO_DEVICE=cpu"):
        gpu_of_this_rank()
