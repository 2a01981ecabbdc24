"""The tiny GPT and the byte corpus: sizes that match their formula, batches that never depend on the split."""

from __future__ import annotations

import pytest
import torch

from zero_offload.workloads import PRESETS, ByteBatches, GPTConfig, TinyGPT, gpt_config, lm_loss, load_corpus


@pytest.mark.parametrize("name", ["nano", "tiny", "small"])
def test_parameter_count_formula_matches_the_model(name):
    model = TinyGPT(name)
    assert sum(p.numel() for p in model.parameters()) == PRESETS[name].num_params()


def test_untied_head_adds_its_own_matrix():
    tied, untied = gpt_config("nano"), gpt_config("nano", tie_weights=False)
    assert untied.num_params() - tied.num_params() == tied.vocab_size * tied.d_model
    model = TinyGPT(untied)
    assert model.lm_head.weight is not model.wte.weight


def test_sizes_span_under_a_million_to_over_a_billion():
    assert PRESETS["tiny"].num_params() < 1_000_000 < 1_000_000_000 < PRESETS["1b"].num_params()


def test_same_seed_same_weights():
    a, b = TinyGPT("nano", seed=7), TinyGPT("nano", seed=7)
    torch.manual_seed(123)  # the global RNG must not matter
    c = TinyGPT("nano", seed=7)
    for pa, pb, pc in zip(a.parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb) and torch.equal(pa, pc)


def test_forward_shapes_and_a_sane_initial_loss():
    model = TinyGPT("nano")
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (3, 20), generator=gen), torch.randint(0, 256, (3, 20), generator=gen)
    logits = model(x)
    assert logits.shape == (3, 20, 256)
    assert abs(lm_loss(logits, y).item() - torch.log(torch.tensor(256.0)).item()) < 0.3
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_bad_model_configs_are_rejected():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(d_model=100, n_head=3)
    with pytest.raises(ValueError, match="preset"):
        gpt_config("huge")


def test_corpus_is_the_course_prose_without_its_quoted_output(tmp_path):
    corpus = load_corpus()  # the snapshot the lessons train on
    assert corpus.dtype == torch.uint8 and len(corpus) > 10_000
    text = bytes(corpus.tolist())
    assert b"ZeRO" in text and "显存".encode() in text
    assert not any(digit in text for digit in b"0123456789") and b"```" not in text
    (tmp_path / "course").mkdir()
    chapter = "intro\n```\nloss 5.460 -> 3.493\n```\nprose, 12.5 ms\n```python\nx = 1\n```\nend\n"
    (tmp_path / "course" / "01.md").write_text(chapter, encoding="utf-8")
    assert bytes(load_corpus(tmp_path).tolist()) == b"intro\nprose, . ms\nend\n"


def test_batches_are_deterministic_and_micro_batches_tile_the_global_batch():
    data = ByteBatches(load_corpus(), 16, seed=5)
    x, y = data.global_batch(3, 8)
    x2, _ = data.global_batch(3, 8)
    assert torch.equal(x, x2) and torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, data.global_batch(4, 8)[0])
    pieces = [
        data.micro_batch(3, 2, micro_step=k, rank=r, world_size=2, accumulation=2)[0]
        for k in range(2)
        for r in range(2)
    ]
    assert torch.equal(torch.cat(pieces), x)
    with pytest.raises(ValueError, match="out of range"):
        data.micro_batch(3, 2, rank=2, world_size=2)


def test_eval_split_is_disjoint_from_train():
    corpus = load_corpus()
    train, held_out = ByteBatches(corpus, 16, split="train"), ByteBatches(corpus, 16, split="eval")
    assert len(train.data) + len(held_out.data) == len(corpus)


def test_lm_loss_takes_its_targets_to_the_logits_device():
    # Batches are made on the CPU and the engine moves only the forward's inputs: on a GPU the logits are on
    # cuda and the targets were not. The meta device shows the same mismatch without a GPU.
    logits = torch.randn(2, 4, 8, device="meta")
    targets = torch.randint(0, 8, (2, 4))
    assert lm_loss(logits, targets).device.type == "meta"
