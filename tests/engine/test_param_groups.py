"""Parameter groups: every Adam path the engine runs gives each group its own lr, betas, eps and weight_decay.

The reference is torch.optim.AdamW with the same groups, on the whole batch in one process. The groups are the
ones every fine-tuning script builds (weights decay, biases and norms do not), with a different lr, betas and
eps on the second, so that a path which read the first group's settings for every unit is caught.
"""

from __future__ import annotations

import pytest
import torch

import zero_offload as zo
from tests.support.corpus import fixed_corpus
from tests.support.distributed import check, run_ranks
from tests.support.training import BATCH, SEQ, train_delayed
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.implementation.durable import CheckpointError
from zero_offload.implementation.schedulers import lr_at
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss

STEPS = 6
DECAY = {"weight_decay": 0.1}
NO_DECAY = {"weight_decay": 0.0, "lr": 2e-3, "betas": (0.8, 0.99), "eps": 1e-4}


def split_groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for name, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for name, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, **DECAY}, {"params": no_decay, **NO_DECAY}]


def config(stage: int, **extra) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 20_000, **extra.pop("zero", {})}
    return {
        "train_batch_size": BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-3}},
        "zero_optimization": zero,
        **extra,
    }


def offload(stage: int, impl: str = "simd", **ext) -> dict:
    return config(
        stage,
        zero={"offload_optimizer": {"device": "cpu"}},
        zero_offload={"cpu_adam": {"impl": impl}, **ext},
    )


def torch_reference(steps: int = STEPS) -> dict:
    """torch.optim.AdamW with the same groups, on the whole batch."""
    model = TinyGPT("nano", seed=0)
    optimizer = torch.optim.AdamW(split_groups(model), lr=1e-3, eps=1e-3)
    data = ByteBatches(fixed_corpus(), SEQ, seed=11)
    for step in range(steps):
        x, y = data.micro_batch(step, BATCH, micro_step=0, rank=0, world_size=1, accumulation=1)
        optimizer.zero_grad()
        lm_loss(model(x), y).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def train_with_groups(rank: int, world_size: int, cfg: dict, steps: int = STEPS) -> dict:
    model = TinyGPT("nano", seed=0)
    engine = zo.initialize(model, cfg, accelerator=EmulatedAccelerator(), param_groups=split_groups(model))
    data = ByteBatches(fixed_corpus(), SEQ, seed=11)
    for step in range(steps):
        x, y = data.micro_batch(step, BATCH // world_size, micro_step=0, rank=rank, world_size=world_size)
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.synchronize()
    with engine.gathered_parameters(list(model.parameters())):
        weights = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    groups = [(len(g["params"]), g["lr"], g["weight_decay"]) for g in engine.optimizer.param_groups]
    engine.close()
    return {"weights": weights, "groups": groups}


def assert_matches_reference(weights: dict, reference: dict) -> None:
    for name, ref in reference.items():
        torch.testing.assert_close(
            weights[name], ref, rtol=2e-5, atol=2e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.fixture(scope="module")
def reference():
    return torch_reference()


ONE_RANK = {
    "stage 0, torch's fused Adam": config(0),
    "stage 1": config(1),
    "stage 3": config(3),
    "stage 2 offload, the C Adam": offload(2, "simd"),
    "stage 3 offload, module 1's naive Adam": offload(3, "naive"),
    "stage 2 offload, the pipeline": offload(2, "torch", overlap_offload=True),
    "stage 2, half offloaded": config(
        2,
        zero={"offload_optimizer": {"device": "cpu", "ratio": 0.5}},
        zero_offload={"cpu_adam": {"impl": "simd"}},
    ),
}


@pytest.mark.parametrize("name", list(ONE_RANK))
def test_each_adam_path_gives_each_group_its_own_settings(name, reference):
    result = train_with_groups(0, 1, ONE_RANK[name])
    assert_matches_reference(result["weights"], reference)


def test_the_nvme_tier_gives_each_group_its_own_settings(tmp_path, reference):
    cfg = config(
        2,
        zero={"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2}},
        zero_offload={"cpu_adam": {"impl": "simd"}},
    )
    assert_matches_reference(train_with_groups(0, 1, cfg)["weights"], reference)


TWO_RANKS = {
    "stage 0": config(0),
    "stage 1 offload, torch's Adam": offload(1, "torch"),
    "stage 2": config(2),
    "stage 3 offload, the C Adam in the pipeline": offload(3, "simd", overlap_offload=True),
}


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_ranks_give_each_group_its_own_settings(name, reference):
    for result in check(run_ranks(train_with_groups, 2, TWO_RANKS[name])):
        assert_matches_reference(result["weights"], reference)


def test_the_optimizer_shows_the_scripts_groups_in_its_order():
    result = train_with_groups(0, 1, config(2), steps=1)
    model = TinyGPT("nano", seed=0)
    # Stage 2 holds one master piece per unit: a module with a weight (decay) and a bias (none) has one unit
    # in each group, a LayerNorm's weight and bias share one.
    # A tied weight (the output head reuses the embedding) belongs to the module that registers it first.
    seen, modules = set(), []
    for module in model.modules():
        modules.append([p for p in module.parameters(recurse=False) if id(p) not in seen])
        seen.update(id(p) for p in modules[-1])
    decay_units = sum(any(p.dim() >= 2 for p in params) for params in modules)
    no_decay_units = sum(any(p.dim() < 2 for p in params) for params in modules)
    assert result["groups"] == [(decay_units, 1e-3, 0.1), (no_decay_units, 2e-3, 0.0)]


def test_the_delayed_update_gives_each_group_its_own_settings():
    """Under DPU the gradient of step t is taken on weights one update old: the reference does the same."""
    start, steps = 2, 5
    model = TinyGPT("nano", seed=0)
    train_delayed(model, torch.optim.AdamW(split_groups(model), lr=1e-3, eps=1e-3), steps, start)
    dpu = {"delayed_param_update": {"enabled": True, "start_step": start}}
    result = train_with_groups(0, 1, offload(2, "simd", overlap_offload=True, **dpu), steps=steps)
    assert_matches_reference(result["weights"], {n: p.detach() for n, p in model.named_parameters()})


# -- checkpoints keep the groups ----------------------------------------------------------------------------
def _engine(cfg: dict, groups=split_groups):
    model = TinyGPT("nano", seed=0)
    return zo.initialize(model, cfg, accelerator=EmulatedAccelerator(), param_groups=groups(model))


def _steps(engine, first: int, count: int) -> list[float]:
    data, losses = ByteBatches(fixed_corpus(), SEQ, seed=11), []
    for step in range(first, first + count):
        x, y = data.micro_batch(step, BATCH, micro_step=0, rank=0, world_size=1)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def test_a_resumed_run_with_groups_equals_the_uninterrupted_one(tmp_path):
    cfg = offload(2, "simd")
    whole = _engine(cfg)
    expected = _steps(whole, 0, 4)
    whole.close()
    first = _engine(cfg)
    _steps(first, 0, 2)
    first.save_checkpoint(tmp_path, tag="step2")
    first.close()
    resumed = _engine(config(3))  # another stage, another placement: the groups are what must match
    resumed.load_checkpoint(tmp_path)
    got = _steps(resumed, 2, 2)
    resumed.close()
    assert got == pytest.approx(expected[2:], rel=1e-5)


def test_loading_a_checkpoint_into_other_groups_is_refused_unless_only_the_weights_are_wanted(tmp_path):
    saver = _engine(config(2))
    _steps(saver, 0, 1)
    saver.save_checkpoint(tmp_path)
    saver.close()
    one_group = _engine(config(2), groups=lambda model: model.parameters())
    with pytest.raises(
        CheckpointError, match="2 parameter group.*this engine has 1.*load_optimizer_states=False"
    ):
        one_group.load_checkpoint(tmp_path)
    one_group.load_checkpoint(tmp_path, load_optimizer_states=False)  # the weights alone go in
    one_group.close()


def test_a_changed_group_setting_loads_with_a_warning_naming_it(tmp_path):
    saver = _engine(config(2))
    saver.save_checkpoint(tmp_path)
    saver.close()

    def other_lr(model):
        groups = split_groups(model)
        groups[1]["lr"] = 5e-3
        return groups

    loader = _engine(config(2), groups=other_lr)
    with pytest.warns(UserWarning, match=r"group 1 lr 0\.002 -> 0\.005"):
        loader.load_checkpoint(tmp_path)
    loader.close()


# -- groups that cannot be ---------------------------------------------------------------------------------
def _bad(make):
    model = TinyGPT("nano", seed=0)
    return zo.initialize(model, config(2), accelerator=EmulatedAccelerator(), param_groups=make(model))


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda m: split_groups(m) + [{"params": [m.wte.weight]}],
            ValueError,
            "is in parameter groups 0 and 2",
        ),
        (lambda m: split_groups(m)[:1], ValueError, r"in no parameter group: .*'.*\.bias'"),
        (lambda m: [{"params": list(m.parameters()), "momentum": 0.9}], ValueError, "sets momentum"),
        (lambda m: [{"params": list(m.parameters()), "lr": -1.0}], ValueError, "group 0: lr must be"),
        (lambda m: [{"params": list(m.parameters()), "betas": (0.9,)}], ValueError, "group 0: betas"),
        (
            lambda m: [{"params": list(m.parameters())}, {"params": [torch.nn.Parameter(torch.ones(2))]}],
            ValueError,
            "not a parameter of the model",
        ),  # fmt: skip
        (lambda m: [{"lr": 1e-3}], ValueError, 'group 0 has no "params"'),
        (lambda m: [{"params": list(m.named_parameters())}], TypeError, "keep the tensor"),
        (lambda m: [{"params": [m.wte.weight]}, m.ln_f.bias], TypeError, "mixes parameter groups"),
    ],
)
def test_impossible_groups_are_refused_by_name(make, error, match):
    with pytest.raises(error, match=match):
        _bad(make)


def test_frozen_parameters_in_a_group_are_left_untrained():
    model = TinyGPT("nano", seed=0)
    model.ln_f.bias.requires_grad_(False)
    before = model.ln_f.bias.detach().clone()
    groups = [{"params": list(model.parameters())}]  # the frozen bias too, as scripts often list it
    engine = zo.initialize(model, config(2), accelerator=EmulatedAccelerator(), param_groups=groups)
    _steps(engine, 0, 1)
    assert torch.equal(model.ln_f.bias.detach().float(), before.float())
    engine.close()


# -- the schedules move each group's lr as DeepSpeed's do ---------------------------------------------------
@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        # WarmupLR works in absolute values: every group gets the schedule's lr, whatever its own.
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 3e-3}}, lambda lr: 3e-3),
        # WarmupCosineLR works in fractions of each group's own lr.
        (
            {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2, "total_num_steps": 10}},
            lambda lr: lr * lr_at("WarmupCosineLR", {"warmup_num_steps": 2, "total_num_steps": 10}, 5, 1.0),
        ),
    ],
)
def test_each_schedule_moves_each_groups_lr_as_deepspeeds_does(schedule, expected):
    engine = _engine({**config(2), "scheduler": schedule})
    _steps(engine, 0, 5)
    assert engine.get_lr() == pytest.approx([expected(1e-3), expected(NO_DECAY["lr"])])
    engine.close()


def _save_on_two_ranks(rank, world_size, folder):
    engine = _engine(offload(2, "simd"))
    data = ByteBatches(fixed_corpus(), SEQ, seed=11)
    for step in range(2):
        x, y = data.micro_batch(step, BATCH // world_size, micro_step=0, rank=rank, world_size=world_size)
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.save_checkpoint(folder)
    engine.close()
    return True


def test_a_checkpoint_with_groups_saved_on_two_ranks_resumes_on_one(tmp_path):
    """The units of a group are cut into other shards at another world size: the pieces find their way back."""
    check(run_ranks(_save_on_two_ranks, 2, str(tmp_path)))
    whole = _engine(offload(2, "simd"))
    expected = _steps(whole, 0, 4)
    whole.close()
    resumed = _engine(offload(2, "simd"))
    resumed.load_checkpoint(tmp_path)
    got = _steps(resumed, 2, 2)
    resumed.close()
    assert got == pytest.approx(expected[2:], rel=1e-4)
