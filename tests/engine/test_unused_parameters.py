"""Parameters that a rank's data never reaches: a mixture of experts where each sample goes to its own expert.

On two ranks with one sample each, rank 0 never touches expert 1 and rank 1 never touches expert 0. Their
gradient hooks fire for different units, so reductions paired by the order hooks fired would add one expert's
gradient to the other's. The buckets pair them by a fixed order instead, each rank adding zero for what it did
not use (principles/buckets.py), and the result must equal one process on both samples. Expert 2 is never routed
to at all: its gradient is zero everywhere, and AdamW still decays it, as in one process.

At stage 3 the ranks would also gather different experts at the same turn; they find out before the collective
and raise on every rank (GatherOrderError), unless the block is declared a leaf module, gathered whole.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import zero_offload as zo
from tests.support.distributed import check, run_ranks
from zero_offload.accelerator import EmulatedAccelerator

STEPS, WIDTH = 3, 8
ADAMW = {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01}
CPU = {"device": "cpu"}
PIPELINE = {"overlap_offload": True}
DPU = {"overlap_offload": True, "delayed_param_update": {"enabled": True, "start_step": 1}}
LEAF = {"leaf_module": {"classes": ["Experts"]}}
# (zero_optimization, zero_offload). A bucket of 80 elements holds one unit: a whole bucket that rank 0 never
# fills, reduced in its turn all the same.
CONFIGS = {
    "0": ({"stage": 0}, {}),
    "1": ({"stage": 1}, {}),
    "1+opt": ({"stage": 1, "offload_optimizer": CPU}, {}),
    "2": ({"stage": 2, "reduce_bucket_size": 80, "overlap_comm": True}, {}),
    "2+opt": ({"stage": 2, "offload_optimizer": CPU}, {}),
    "2+opt+pipeline": ({"stage": 2, "offload_optimizer": CPU, "reduce_bucket_size": 80}, PIPELINE),
    "2+opt+dpu": ({"stage": 2, "offload_optimizer": CPU}, DPU),
    "3+leaf": ({"stage": 3, **LEAF}, {}),
    "3+opt+leaf": ({"stage": 3, "offload_optimizer": CPU, "reduce_bucket_size": 80, **LEAF}, PIPELINE),
    "3+opt+param+leaf": ({"stage": 3, "offload_optimizer": CPU, "offload_param": CPU, **LEAF}, {}),
}


class Experts(nn.Module):
    """A shared layer, then each sample through the expert `route` names for it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))

    def forward(self, x: torch.Tensor, route: list[int]) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return torch.cat([self.experts[e](h[i : i + 1]) for i, e in enumerate(route)])


ROUTE = [0, 1]  # sample i goes to expert i; expert 2 is never used


def samples(step: int) -> torch.Tensor:
    return torch.randn(len(ROUTE), WIDTH, generator=torch.Generator().manual_seed(step))


def config(name: str) -> dict:
    zero, extension = CONFIGS[name]
    return {"train_batch_size": len(ROUTE), "zero_optimization": zero, "zero_offload": extension,
            "optimizer": {"type": "AdamW", "params": ADAMW}}  # fmt: skip


def train(rank: int, world_size: int, names: list[str]) -> dict:
    """Each config on this rank's samples: the final full weights and the reduced gradient norms."""
    results = {}
    for name in names:
        model = Experts()
        engine = zo.initialize(model, config(name), accelerator=EmulatedAccelerator())
        rows = slice(rank * len(ROUTE) // world_size, (rank + 1) * len(ROUTE) // world_size)
        for step in range(STEPS):
            out = engine(samples(step)[rows], ROUTE[rows])
            engine.backward(out.pow(2).mean())
            engine.step()
        engine.synchronize()  # the delayed update's last step lands
        weights = {n: w.float().clone() for n, w in engine.consolidated_state_dict().items()}
        results[name] = {"weights": weights, "norms": [r["grad_norm"] for r in engine.history]}
        engine.close()
    return results


def reference() -> dict[str, torch.Tensor]:
    """torch.optim.AdamW on both samples, an unused parameter's gradient taken as zero (not skipped)."""
    model = Experts()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in range(STEPS):
        model(samples(step), ROUTE).pow(2).mean().backward()
        for param in model.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_close(weights, expected, what):
    for name, ref in expected.items():
        diff = (weights[name] - ref).abs().max().item()
        assert diff <= 1e-5 * ref.abs().max().item(), f"{what}: {name} differs by {diff:.3g}"


@pytest.fixture(scope="module")
def one_process():
    return train(0, 1, list(CONFIGS))


@pytest.fixture(scope="module")
def two_ranks():
    return check(run_ranks(train, 2, list(CONFIGS), timeout_s=120))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_ranks_that_use_different_experts_train_like_one_process(one_process, two_ranks, name):
    single = one_process[name]
    for rank, result in enumerate(two_ranks):
        assert_close(result[name]["weights"], single["weights"], f"stage {name}, rank {rank}")
        # Adam hides a wrongly scaled gradient; the reduced norms do not.
        assert result[name]["norms"] == pytest.approx(single["norms"], rel=1e-5), f"stage {name}: norms"


def test_one_process_equals_adamw_with_unused_gradients_as_zeros(one_process):
    expected = reference()
    for name in CONFIGS:
        if "dpu" not in name:  # the delayed update applies each gradient one step late
            assert_close(one_process[name]["weights"], expected, f"stage {name}, one process")
    # Expert 2 was never used, yet AdamW's decay moved it: its gradient was zero, not missing.
    assert not torch.equal(expected["experts.2.weight"], Experts().experts[2].weight.detach())


def _stage3_without_leaf(rank, world_size):
    zero = {"stage": 3}
    cfg = {"train_batch_size": 2, "zero_optimization": zero, "optimizer": {"type": "AdamW", "params": ADAMW}}
    model = Experts()
    engine = zo.initialize(model, cfg, accelerator=EmulatedAccelerator())
    before = {n: w.clone() for n, w in engine.consolidated_state_dict().items()}
    try:
        out = engine(samples(0)[rank : rank + 1], ROUTE[rank : rank + 1])
        engine.backward(out.pow(2).mean())
        engine.step()
    except zo.GatherOrderError as err:
        after = engine.consolidated_state_dict()
        unchanged = all(torch.equal(before[n], after[n]) for n in before)
        engine.close()
        return {"error": str(err), "unchanged": unchanged}
    engine.close()
    return {"error": None}


def test_stage3_without_a_leaf_raises_on_every_rank_naming_the_experts_and_the_fix():
    for result in check(run_ranks(_stage3_without_leaf, 2, timeout_s=60)):
        assert result["error"] is not None, "stage 3 trained experts that each rank gathered differently"
        assert "experts.0" in result["error"] and "experts.1" in result["error"]
        assert '"leaf_module": {"classes": ["Experts"]}' in result["error"]
        assert result["unchanged"]


def test_a_leaf_module_that_matches_nothing_is_an_error_naming_the_key():
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 3, "leaf_module": {"names": ["expert"]}}}
    with pytest.raises(ValueError, match=r"leaf_module\.names: 'expert' matches no module"):
        zo.initialize(Experts(), cfg, accelerator=EmulatedAccelerator())
