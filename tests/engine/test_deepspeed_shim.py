"""A DeepSpeed training script with one import changed: `import zero_offload.deepspeed as deepspeed`.

The script below has the shape of DeepSpeed's getting-started guide: add_config_arguments, init_distributed,
initialize with training_data, a loop over the loader it returns, save_checkpoint with a tag and client_state,
load_checkpoint of the latest save. It runs as a user runs it, under torchrun on 2 ranks and as one plain process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import zero_offload as zo
import zero_offload.deepspeed as deepspeed
from tests.support.distributed import free_port
from zero_offload.config import load_config
from zero_offload.implementation.checkpoint import CheckpointError
from zero_offload.workloads import TinyGPT, lm_loss

CONFIG = {
    "train_batch_size": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "eps": 1e-3, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 3e-3}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
}

SCRIPT = textwrap.dedent(
    """
    import argparse, json, sys, torch
    import zero_offload as zo
    import zero_offload.deepspeed as deepspeed
    from zero_offload.workloads import TinyGPT, ByteBatches, load_corpus, lm_loss

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--out")
    parser.add_argument("--save_dir")
    args = parser.parse_args()
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def fresh_model():
        torch.manual_seed(0)
        return TinyGPT("nano")

    def groups(net):  # as fine-tuning scripts build them: no decay for biases and norms
        decay = [p for n, p in net.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in net.named_parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]

    def dataset():
        data = ByteBatches(load_corpus(), 32)
        pairs = [data.micro_batch(i, 1) for i in range(48)]
        return torch.utils.data.TensorDataset(torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs]))

    def train(engine, loader, start=0, save_at=None):
        losses = []
        for step, (x, y) in enumerate(loader):
            if step < start:
                continue
            loss = lm_loss(engine(x.to(engine.device)), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if step + 1 == save_at:
                engine.save_checkpoint(args.save_dir, tag="half", client_state={"step": step + 1, "rank": rank})
        return losses

    # DeepSpeed's way.
    net = fresh_model()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=groups(net), training_data=dataset())
    engine.train()
    result = {
        "world_size": engine.world_size, "global_rank": engine.global_rank, "local_rank": engine.local_rank,
        "train_batch_size": engine.train_batch_size(), "micro": engine.train_micro_batch_size_per_gpu(),
        "batches": len(loader), "sampler": type(loader.sampler).__name__,
        "same_optimizer": optimizer is engine.optimizer, "same_scheduler": scheduler is engine.lr_scheduler,
    }
    result["deepspeed"] = train(engine, loader, save_at=3)
    result["lr"] = engine.get_lr()
    engine.close()

    # The same model and batches through zo.initialize, with the loader built by hand.
    net = fresh_model()
    engine = zo.initialize(net, args.deepspeed_config, param_groups=groups(net))
    data = dataset()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank)
    loader = torch.utils.data.DataLoader(data, batch_size=8 // world, sampler=sampler)
    result["zo"] = train(engine, loader)
    engine.close()

    # A new run that resumes from the latest save, and goes on where client_state says.
    net = fresh_model()
    engine, _, loader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=groups(net), training_data=dataset())
    path, client_state = engine.load_checkpoint(args.save_dir)
    result.update(path=path, client_state=client_state, resumed_at=engine.global_steps)
    result["resumed"] = train(engine, loader, start=client_state["step"])
    with open(f"{args.out}.rank{rank}.json", "w") as file:
        json.dump(result, file)
    """
)


def _run(tmp_path, nproc: int | None) -> list[dict]:
    script, config = tmp_path / "train.py", tmp_path / "ds_config.json"
    script.write_text(SCRIPT)
    config.write_text(json.dumps(CONFIG))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZO_DEVICE": "cpu"}
    env.pop("WORLD_SIZE", None)
    options = ["--deepspeed", "--deepspeed_config", str(config), "--out", str(tmp_path / "out")]
    options += ["--save_dir", str(tmp_path / "checkpoints")]
    command = [sys.executable, str(script), *options]
    if nproc is not None:
        command[1:1] = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
        command[5:5] = ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = nproc or 1
    return [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [None, 2], ids=["one process", "torchrun 2 ranks"])
def test_a_deepspeed_script_trains_as_zo_initialize_and_resumes_from_its_latest_tag(tmp_path, nproc):
    results = _run(tmp_path, nproc)
    world = nproc or 1
    for rank, result in enumerate(results):
        assert (result["world_size"], result["global_rank"], result["local_rank"]) == (world, rank, rank)
        assert (result["train_batch_size"], result["micro"]) == (8, 8 // world)
        # 48 samples, each rank its 48 / world of them, a micro-batch at a time.
        assert result["sampler"] == "DistributedSampler" and result["batches"] == 48 // world // (8 // world)
        assert result["same_optimizer"] and result["same_scheduler"]
        # The shim adds nothing to the engine: the same losses, bit for bit, as zo.initialize.
        assert result["deepspeed"] == result["zo"]
        # WarmupLR reached its top after 4 of 6 steps; as DeepSpeed's, it sets every group's lr alike.
        assert result["lr"] == [pytest.approx(3e-3)] * 2
        # The latest save is tag "half", after 3 steps; each rank gets back the client_state it saved.
        assert result["path"] == str(tmp_path / "checkpoints" / "half")
        assert result["client_state"] == {"step": 3, "rank": rank} and result["resumed_at"] == 3
        assert result["resumed"] == result["deepspeed"][3:]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "half"


# -- initialize: what it refuses, and why -------------------------------------------------------------------
def _config(**extra):
    return {**CONFIG, "zero_optimization": {"stage": 0}, **extra}


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"mpu": object()}, "mpu"),
        ({"optimizer": "client"}, '"optimizer"'),
        ({"lr_scheduler": "client"}, '"scheduler"'),
        ({"model_parameters": "mixed"}, "mixes parameter groups"),
        ({"model_parameters": "subset"}, "requires_grad=False"),
    ],
)
def test_initialize_refuses_what_the_engine_cannot_honour_naming_the_fix(kwargs, named):
    model = torch.nn.Linear(4, 4)
    if kwargs.get("optimizer") == "client":
        kwargs["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
    if kwargs.get("lr_scheduler") == "client":
        kwargs["lr_scheduler"] = torch.optim.lr_scheduler.LambdaLR(
            torch.optim.SGD(model.parameters()), lambda s: 1
        )
    if kwargs.get("model_parameters") == "mixed":
        kwargs["model_parameters"] = [{"params": [model.weight]}, model.bias]
    if kwargs.get("model_parameters") == "subset":
        kwargs["model_parameters"] = [model.weight]
    with pytest.raises((NotImplementedError, ValueError, TypeError), match=named):
        deepspeed.initialize(model=model, config=_config(), **kwargs)


def test_a_client_adamw_becomes_the_optimizer_section_and_its_groups_the_parameter_groups():
    model = torch.nn.Linear(4, 4)
    client = torch.optim.AdamW(
        [{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0, "lr": 5e-3}],
        lr=2e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05,
    )  # fmt: skip
    config = {k: v for k, v in _config().items() if k not in ("optimizer", "scheduler")}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config)
    assert optimizer is engine.optimizer and optimizer is not client
    assert engine.config.optimizer.type == "AdamW" and engine.config.optimizer.betas == (0.8, 0.9)
    settings = [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in optimizer.param_groups]
    assert settings == [(2e-3, (0.8, 0.9), 1e-6, 0.05), (5e-3, (0.8, 0.9), 1e-6, 0.0)]
    engine.close()
    l2 = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=l2, config=config)
    assert engine.config.optimizer.type == "Adam" and not engine.config.optimizer.adamw  # torch's Adam: L2
    engine.close()


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), "amsgrad"),
        (lambda m: torch.optim.AdamW(m.parameters()), "both optimizer="),
    ],
)
def test_a_client_optimizer_the_engine_cannot_run_as_it_would_is_refused(make, named):
    model = torch.nn.Linear(4, 4)
    config = (
        _config() if named == "both optimizer=" else {k: v for k, v in _config().items() if k != "optimizer"}
    )
    with pytest.raises((NotImplementedError, ValueError), match=named):
        deepspeed.initialize(model=model, optimizer=make(model), config=config)


def test_the_config_comes_from_config_or_args_never_both():
    model = torch.nn.Linear(4, 4)
    args = deepspeed.add_config_arguments(__import__("argparse").ArgumentParser()).parse_args(
        ["--deepspeed", "--deepspeed_config", "ds.json"]
    )
    assert args.deepspeed and args.deepspeed_config == "ds.json"
    with pytest.raises(ValueError, match="given twice"):
        deepspeed.initialize(args=args, model=model, config=_config())
    with pytest.raises(ValueError, match="no config"):
        deepspeed.initialize(model=model)
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, config_params=_config())
    assert optimizer is engine.optimizer and loader is None and scheduler is engine.lr_scheduler
    assert engine.module is model and engine.eval() is engine and not model.training
    engine.close()


def test_dataloader_drop_last_is_read_from_the_config_and_leaves_other_fingerprints_alone():
    data = torch.utils.data.TensorDataset(torch.arange(20.0).reshape(10, 2))
    for drop_last, batches in ((False, 2), (True, 1)):
        config = _config(train_batch_size=6, dataloader_drop_last=drop_last)
        engine, _, loader, _ = deepspeed.initialize(
            model=torch.nn.Linear(2, 2), config=config, training_data=data
        )
        assert (loader.batch_size, loader.drop_last, len(loader)) == (6, drop_last, batches)
        engine.close()
    # Written out as false, it is the default: the config means the same as one without it.
    plain = load_config(_config())
    assert load_config(_config(dataloader_drop_last=False)).fingerprint() == plain.fingerprint()
    assert load_config(_config(dataloader_drop_last=True)).fingerprint() != plain.fingerprint()


def test_init_distributed_without_a_launcher_makes_a_group_of_one_and_names_a_wrong_argument(monkeypatch):
    with pytest.raises(TypeError, match="dist_bakend"):
        deepspeed.init_distributed(dist_bakend="gloo")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        # Set first, so that the fixture records each one and takes away what init_distributed sets: a WORLD_SIZE
        # left behind would reach every later test's ranks.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=True)
    try:
        assert torch.distributed.get_world_size() == 1 and torch.distributed.get_rank() == 0
        deepspeed.init_distributed()  # a group that exists is kept
    finally:
        torch.distributed.destroy_process_group()


def test_gathered_parameters_finds_the_engine_and_spreads_the_modifier_ranks_weights():
    model = TinyGPT("nano")
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    head = next(model.parameters())
    with deepspeed.zero.GatheredParameters(head, modifier_rank=0):
        head.data.fill_(0.25)
    with deepspeed.zero.GatheredParameters([head]):
        assert torch.all(head.float() == 0.25)
    engine.close()
    with pytest.raises(ValueError, match="no open engine"):
        with deepspeed.zero.GatheredParameters(torch.nn.Linear(2, 2).parameters()):
            pass


# -- checkpoints: tag, client_state, latest, and what a load may leave out ------------------------------------
def _trained(steps=2, config=None):
    torch.manual_seed(0)
    model = TinyGPT("nano")
    engine = zo.initialize(model, config or {**CONFIG, "zero_optimization": {"stage": 2}})
    x = torch.randint(0, 256, (8, 16))
    for _ in range(steps):
        engine.backward(lm_loss(engine(x), x))
        engine.step()
    return engine


def test_a_client_state_that_would_not_load_safely_is_refused_and_the_last_save_stays(tmp_path):
    engine = _trained()
    engine.save_checkpoint(tmp_path, tag="good", client_state={"step": 2, "position": torch.tensor([5, 7])})
    with pytest.raises(TypeError, match="weights_only"):
        engine.save_checkpoint(tmp_path, tag="bad", client_state={"sampler": object()})
    assert not (tmp_path / "bad").exists() and (tmp_path / "latest").read_text().strip() == "good"
    path, client_state = engine.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "good") and client_state["step"] == 2
    assert torch.equal(client_state["position"], torch.tensor([5, 7]))
    engine.close()


def test_save_latest_false_leaves_latest_and_a_tag_loads_by_name(tmp_path):
    engine = _trained()
    engine.save_checkpoint(tmp_path, tag="first")
    engine.backward(lm_loss(engine(torch.randint(0, 256, (8, 16))), torch.randint(0, 256, (8, 16))))
    engine.step()
    engine.save_checkpoint(tmp_path, tag="second", save_latest=False, client_state={"n": 3})
    assert (tmp_path / "latest").read_text().strip() == "first"
    assert engine.load_checkpoint(tmp_path) == (str(tmp_path / "first"), {})
    assert engine.global_steps == 2
    assert engine.load_checkpoint(tmp_path, tag="second") == (str(tmp_path / "second"), {"n": 3})
    assert engine.global_steps == 3
    with pytest.raises(CheckpointError):
        engine.load_checkpoint(tmp_path, tag="../elsewhere")
    engine.close()


def test_loading_the_module_only_or_without_the_optimizer_starts_adam_afresh_from_the_weights(tmp_path):
    saved = _trained(steps=3)
    saved.save_checkpoint(tmp_path)
    weights = {n: p.detach().clone() for n, p in saved.model.named_parameters()}
    saved.close()
    for options, steps in (({"load_module_only": True}, 0), ({"load_optimizer_states": False}, 3)):
        engine = _trained(steps=0)
        engine.load_checkpoint(tmp_path, **options)
        assert engine.global_steps == steps
        for name, param in engine.model.named_parameters():
            assert torch.equal(param.detach(), weights[name]), name
        # Adam afresh: zero moments and a step count of 0, so the next step is Adam's first.
        assert float(engine.states.exp_avg.abs().max()) == 0.0
        assert float(engine.optimizer.state[engine.states.master_params[0]]["step"]) == 0.0
        engine.close()


# -- examples/deepspeed_getting_started, as its README runs it ---------------------------------------------
EXAMPLE = os.path.join(
    os.path.dirname(__file__), os.pardir, os.pardir, "examples", "deepspeed_getting_started"
)


@pytest.mark.slow
def test_the_getting_started_example_resumes_from_its_latest_tag_with_the_same_losses(tmp_path):
    def run(*extra):
        command = [sys.executable, os.path.join(EXAMPLE, "train.py"), "--deepspeed", "--deepspeed_config"]
        command += [os.path.join(EXAMPLE, "ds_config.json"), "--save-dir", str(tmp_path / "ckpt"), *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "ZO_DEVICE": "cpu"}
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-4000:]
        return done.stdout

    run("--steps", "6", "--save-every", "3", "--losses", str(tmp_path / "whole.json"))
    # As if the run had stopped after its first save: the second is not there, and `latest` names the first.
    shutil.rmtree(tmp_path / "ckpt" / "step6")
    (tmp_path / "ckpt" / "latest").write_text("step3\n")
    out = run("--steps", "6", "--save-every", "3", "--resume", "--losses", str(tmp_path / "resumed.json"))
    assert "resumed from" in out and "step3" in out
    whole = json.loads((tmp_path / "whole.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert sorted(resumed) == ["4", "5", "6"] and resumed == {k: whole[k] for k in resumed}
