"""Models the project did not write: Hugging Face GPT-2, Llama and BERT (built from tiny configs, nothing is
downloaded) and PyTorch's own nn.TransformerEncoder, trained through `zo.initialize` as their users call them.

Every run is compared with plain PyTorch: the same model trained by torch.optim.AdamW on the whole batch, in fp32
with no clipping and an eps of 1e-3, large enough that a gradient off by a constant factor (summed over ranks
instead of averaged, a loss scale left in) would change the weights.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.nn as nn

import zero_offload as zo
from tests.support.distributed import run_ranks
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.principles.stage3_params import PartitionedAccessError

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, VOCAB = 3, 4, 16, 64
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-3, "weight_decay": 0.1}
ZERO = {
    0: {"stage": 0},
    2: {"stage": 2},
    3: {"stage": 3},
    "3+offload": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
}


def build(kind: str) -> nn.Module:
    """A tiny model of each family, without dropout, so that any split of the batch gives the same training."""
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return transformers.GPT2LMHeadModel(config)  # its output head is tied to the embedding
    if kind == "llama":
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                          max_position_embeddings=SEQ)  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    return transformers.BertForMaskedLM(config)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))


def reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """torch.optim.AdamW on the whole batch: the losses and the final weights."""
    model = build(kind).train()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for step in range(STEPS):
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train(kind: str, stage, recompute: str | None, *, rank: int = 0, world: int = 1):
    """`kind` through the engine on this rank's rows of every batch; the losses and the full final weights."""
    model = build(kind).train()
    config = {"train_batch_size": BATCH, "zero_optimization": ZERO[stage],
              "optimizer": {"type": "AdamW", "params": dict(ADAMW, betas=list(ADAMW["betas"]))}}  # fmt: skip
    if recompute == "engine":
        config["activation_checkpointing"] = {}
    elif recompute == "model":  # the model's own, non-reentrant (transformers' default)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # use_cache turned off for recomputation, said by both libraries
        engine = zo.initialize(model, config, accelerator=EmulatedAccelerator())
        rows = BATCH // world
        losses = []
        for step in range(STEPS):
            ids = batch(step)[rank * rows : (rank + 1) * rows]
            output = engine(input_ids=ids, labels=ids)  # keywords in, Hugging Face's ModelOutput back
            engine.backward(output.loss)
            engine.step()
            losses.append(output.loss.item())
    return losses, {k: v.float() for k, v in model.state_dict().items()}, engine


def assert_same_weights(got: dict, expected: dict, what) -> None:
    for name, weight in expected.items():
        torch.testing.assert_close(
            got[name], weight, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{what} {name}: {m}"
        )


CASES = [(kind, stage, None) for kind in ("gpt2", "llama", "bert") for stage in (0, 2, 3, "3+offload")] + [
    (kind, stage, recompute)
    for kind in ("gpt2", "llama", "bert")
    for stage in (0, 3)
    for recompute in ("engine", "model")
]


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_hugging_face_models_train_like_torch_adamw_at_every_stage_with_both_recomputations(kind):
    losses, weights = reference(kind)
    for case_kind, stage, recompute in CASES:
        if case_kind != kind:
            continue
        got_losses, got_weights, _ = train(kind, stage, recompute)
        assert got_losses == pytest.approx(losses, rel=1e-5), (stage, recompute)
        assert_same_weights(got_weights, weights, (stage, recompute))


def _two_ranks(rank, world_size):
    results = {}
    for kind in ("gpt2", "llama", "bert"):
        for stage, recompute in ((0, None), (2, None), (3, None), (3, "engine"), (3, "model")):
            _, weights, _ = train(kind, stage, recompute, rank=rank, world=world_size)
            results[f"{kind} stage {stage} recompute {recompute}"] = weights
    return results


@pytest.mark.slow
def test_hugging_face_models_on_two_ranks_equal_torch_adamw_on_the_whole_batch():
    ranks = run_ranks(_two_ranks, 2, timeout_s=240)
    for result in ranks:
        assert "__error__" not in result and "__exitcode__" not in result, result
    references = {kind: reference(kind)[1] for kind in ("gpt2", "llama", "bert")}
    for name, weights in ranks[0].items():
        assert_same_weights(weights, references[name.split()[0]], f"rank 0, {name}")
    for name, weights in ranks[1].items():  # every rank's state_dict is the whole, gathered model
        assert_same_weights(weights, ranks[0][name], f"rank 1 vs rank 0, {name}")


# -- stage 3 on PyTorch's own transformer: MultiheadAttention reads out_proj.weight without calling out_proj -----
def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.Linear(8, 32), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))


@pytest.mark.parametrize("stage", [3, "3+offload"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_torch_transformer_encoder_trains_at_stage_3_as_at_stage_0(stage, accumulation):
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1))
    results = {}
    for key in (0, stage):
        model = _encoder()
        config = {"train_batch_size": 4, "gradient_accumulation_steps": accumulation,
                  "zero_optimization": ZERO[key], "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-3}}}  # fmt: skip
        engine = zo.initialize(model, config, accelerator=EmulatedAccelerator())
        losses = []
        for _ in range(3):
            for micro in x.chunk(accumulation):
                loss = engine(micro).pow(2).mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        results[key] = losses, {k: v.float() for k, v in model.state_dict().items()}
    assert results[stage][0] == pytest.approx(results[0][0], rel=1e-5)
    assert_same_weights(results[stage][1], results[0][1], stage)


# -- stage 3 outside forward ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stage3_gpt2():
    losses, weights, engine = train("gpt2", 3, None)
    return engine, weights


def test_a_plain_op_on_a_partitioned_parameter_is_an_error_that_names_the_api(stage3_gpt2):
    engine, _ = stage3_gpt2
    param = engine.model.transformer.h[0].attn.c_attn.weight
    for op in (
        lambda p: p.sum(),
        lambda p: p.norm(),
        lambda p: p.clone(),
        lambda p: p.data.sum(),
        lambda p: p + 1,
    ):
        with pytest.raises(PartitionedAccessError, match="gathered_parameters"):
            op(param)
    assert "partitioned by ZeRO stage 3" in repr(param) and "gathered_parameters" in str(param)
    assert list(param.shape) == [32, 96] and param.dtype == torch.float32 and param.requires_grad  # metadata


def test_state_dict_torch_save_and_save_pretrained_give_full_loadable_weights(stage3_gpt2, tmp_path):
    engine, weights = stage3_gpt2
    model = engine.model
    state = model.state_dict()
    assert_same_weights(state, weights, "state_dict")
    assert state["lm_head.weight"] is state["transformer.wte.weight"]  # tied: one tensor, as without ZeRO
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fresh = build("gpt2")
    fresh.load_state_dict(torch.load(buffer, weights_only=True), strict=True)
    assert_same_weights({k: v.float() for k, v in fresh.state_dict().items()}, weights, "torch.save")
    model.save_pretrained(tmp_path / "hf")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert_same_weights({k: v.float() for k, v in loaded.state_dict().items()}, weights, "save_pretrained")
    consolidated = engine.consolidated_state_dict()
    assert_same_weights(consolidated, weights, "consolidated_state_dict")


def test_eval_and_generate_under_no_grad_keep_working(stage3_gpt2):
    engine, weights = stage3_gpt2
    model = engine.model.eval()
    fresh = build("gpt2").eval()
    fresh.load_state_dict(weights)
    prompt = batch(0)[:1, :4]
    with torch.no_grad():
        ours = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        theirs = fresh.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    model.train()
    assert torch.equal(ours, theirs)


def _edit_on_rank_0(rank, world_size):
    """Rank 0 zeroes a weight inside gathered_parameters(modifier_rank=0); every rank trains on from there."""
    model = _encoder()
    config = {"train_batch_size": 4, "zero_optimization": ZERO[3],
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-3}}}  # fmt: skip
    engine = zo.initialize(model, config, accelerator=EmulatedAccelerator())
    weight = model[0].weight
    with engine.gathered_parameters(modifier_rank=0):
        read = weight.detach().clone()  # the full weight, on every rank
        if rank == 0:
            weight.data.fill_(0.25)
    with engine.gathered_parameters([weight]):
        after = weight.detach().clone()
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1))[rank * 2 : rank * 2 + 2]
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return {"read": read, "after": after, "final": model.state_dict()["0.weight"]}


@pytest.mark.slow
def test_gathered_parameters_reads_full_weights_and_adopts_one_ranks_edit_everywhere():
    ranks = run_ranks(_edit_on_rank_0, 2)
    for result in ranks:
        assert "__error__" not in result and "__exitcode__" not in result, result
    expected = _encoder()[0].weight.detach()
    for result in ranks:
        torch.testing.assert_close(result["read"], expected)
        assert torch.all(result["after"] == 0.25)  # rank 1 sees rank 0's edit, fp32 master included:
    torch.testing.assert_close(ranks[0]["final"], ranks[1]["final"])
    assert not torch.allclose(ranks[0]["final"], torch.full_like(expected, 0.25))  # the step moved from 0.25
    assert (ranks[0]["final"] - 0.25).abs().max() < 0.02  # ... by about lr, not back to the old weights


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_torch_transformer_encoder_in_low_precision_trains_out_proj_on_the_emulated_device(precision):
    # The emulated device computes in fp32 by upcasting each module's weights as it runs; out_proj is read by
    # MultiheadAttention without running, so its weights are upcast with the attention's own.
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1))
    results = {}
    for stage in (0, 3):
        model = _encoder()
        before = model[1].layers[0].self_attn.out_proj.weight.detach().clone()
        config = {"train_batch_size": 4, precision: {"enabled": True}, "zero_optimization": ZERO[stage],
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-3}}}  # fmt: skip
        engine = zo.initialize(model, config, accelerator=EmulatedAccelerator())
        losses = []
        for _ in range(3):
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        after = model.state_dict()["1.layers.0.self_attn.out_proj.weight"].float()
        assert not torch.allclose(after, before), stage  # trained, not left behind
        results[stage] = losses, {k: v.float() for k, v in model.state_dict().items()}
    assert results[3][0] == results[0][0]
    assert_same_weights(results[3][1], results[0][1], precision)
