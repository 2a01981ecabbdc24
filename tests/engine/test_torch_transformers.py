"""PyTorch's own nn.TransformerEncoder, nn.TransformerDecoder and nn.Transformer, trained on two ranks at every
ZeRO stage with each offload combination, against torch.optim.AdamW in one process on the whole batch.

nn.MultiheadAttention reads `out_proj.weight` without calling `out_proj`, so at stage 3 that unit is gathered on
the spot, inside another module's forward (stage3_params.py), and from the second step on it is also prefetched.
A read that does not wait for the prefetch's all-gather sees a half-written buffer: on one process the gather is a
copy and hides it; on two ranks it trained on NaN and on values like 1e22. `deferred_gathers` makes every
asynchronous gather land only when waited for, so such a read sees NaN every time, not on a slow day.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import zero_offload as zo
from tests.support.distributed import check, run_ranks
from tests.support.interleave import deferred_gathers
from zero_offload.accelerator import EmulatedAccelerator

STEPS, BATCH, SEQ, VOCAB, WIDTH = 10, 8, 16, 64, 32
# eps 1e-3, no clipping: a gradient off by a constant factor (summed, not averaged) would show in the weights.
ADAMW = {"lr": 3e-3, "betas": (0.9, 0.999), "eps": 1e-3, "weight_decay": 0.01}
CPU = {"device": "cpu"}
CONFIGS = {
    "1": {"stage": 1},
    "1+opt": {"stage": 1, "offload_optimizer": CPU},
    "2": {"stage": 2},
    "2+opt": {"stage": 2, "offload_optimizer": CPU},
    "3": {"stage": 3},
    "3+opt": {"stage": 3, "offload_optimizer": CPU},
    "3+opt+param": {"stage": 3, "offload_optimizer": CPU, "offload_param": CPU},
}
STAGE3 = ("3", "3+opt", "3+opt+param")
CASES = [("encoder", name) for name in CONFIGS] + [(k, n) for k in ("decoder", "transformer") for n in STAGE3]


class Seq2Seq(nn.Module):
    """Token embedding, one of torch's three transformer stacks (two layers), an output head."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = dict(
            d_model=WIDTH, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True, norm_first=True
        )
        if kind == "encoder":
            self.body = nn.TransformerEncoder(
                nn.TransformerEncoderLayer(**layer), num_layers=2, enable_nested_tensor=False
            )
        elif kind == "decoder":
            self.body = nn.TransformerDecoder(nn.TransformerDecoderLayer(**layer), num_layers=2)
        else:
            self.body = nn.Transformer(num_encoder_layers=2, num_decoder_layers=2, **layer)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if self.kind == "encoder":
            return self.head(self.body(x))
        # The decoder attends to the sequence itself as its "memory"; the full transformer encodes it first.
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.body(x, x, tgt_mask=mask, tgt_is_causal=True))


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return Seq2Seq(kind).train()


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(200 + step))


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build(kind)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for step in range(STEPS):
        ids = batch(step)
        loss = loss_of(model(ids), ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_cases(rank, world_size, cases, deferred):
    """Every case on this rank's rows of each batch; (losses, full final weights) per case."""
    results = {}
    for kind, name in cases:
        model = build(kind)
        config = {"train_batch_size": BATCH, "zero_optimization": CONFIGS[name],
                  "optimizer": {"type": "AdamW", "params": dict(ADAMW, betas=list(ADAMW["betas"]))}}  # fmt: skip
        engine = zo.initialize(model, config, accelerator=EmulatedAccelerator())
        rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
        losses = []
        with deferred_gathers() if deferred else contextlib.nullcontext():
            for step in range(STEPS):
                ids = batch(step)[rows]
                loss = loss_of(engine(ids), ids)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        weights = {n: w.float() for n, w in engine.consolidated_state_dict().items()}
        engine.close()
        results[(kind, name)] = (losses, weights)
    return results


@pytest.fixture(scope="module")
def references():
    return {kind: reference(kind) for kind in ("encoder", "decoder", "transformer")}


@pytest.fixture(scope="module")
def two_ranks():
    return check(run_ranks(_train_cases, 2, CASES, False, timeout_s=240))


def _assert_matches(result, expected, what):
    """The final weights within 1e-5 of each tensor's largest value."""
    weights, ref_weights = result[1], expected[1]
    for name, ref in ref_weights.items():
        scale = ref.abs().max().item()
        diff = (weights[name] - ref).abs().max().item()
        assert diff <= 1e-5 * scale, f"{what}: {name} differs by {diff:.3g} ({diff / scale:.2g} relative)"


@pytest.mark.slow
@pytest.mark.parametrize("kind, name", CASES, ids=[f"{k}-stage{n}" for k, n in CASES])
def test_two_ranks_train_torch_transformers_like_one_process(two_ranks, references, kind, name):
    ranks = [result[(kind, name)] for result in two_ranks]
    # The whole batch's loss is the mean of the two halves' losses.
    mean_losses = [sum(step) / 2 for step in zip(ranks[0][0], ranks[1][0], strict=True)]
    ref_losses = references[kind][0]
    assert mean_losses == pytest.approx(ref_losses, rel=1e-5), f"{kind} at stage {name}: losses"
    for rank, result in enumerate(ranks):
        _assert_matches(result, references[kind], f"{kind}, stage {name}, rank {rank}")


def test_stage3_waits_for_a_prefetch_before_an_op_reads_the_unit(references):
    """Every prefetched gather lands late (NaN until waited for): reading out_proj.weight on the spot must wait."""
    cases = [("encoder", "3"), ("encoder", "3+opt+param")]
    for result in check(run_ranks(_train_cases, 2, cases, True, timeout_s=120)):
        for case in cases:
            losses, _ = result[case]
            assert all(torch.isfinite(torch.tensor(losses))), f"{case}: a forward read a gather in flight"
            _assert_matches(result[case], references["encoder"], f"{case} with deferred gathers")
