"""Module 1 (basics) beyond the lab: the naive Adam against torch.optim over 100 steps, the ledger on real models."""

from __future__ import annotations

import inspect

import pytest
import torch

from zero_offload.basics import Adam, MemoryLedger, estimate_model_states
from zero_offload.workloads import TinyGPT, lm_loss


def _max_relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp_min(1e-12)).max())


@pytest.mark.parametrize("adamw", [False, True], ids=["Adam", "AdamW"])
def test_naive_adam_matches_torch_over_100_steps(adamw):
    # The same gradients go to both optimizers: with gradients from a model, rounding differences would feed
    # back through the forward pass and measure the model's chaos instead of the optimizer.
    shapes = [(64, 32), (32,), (7, 3, 5), (1,)]
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    kwargs = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    opt = Adam(ours, adamw=adamw, **kwargs)
    ref = (torch.optim.AdamW if adamw else torch.optim.Adam)(theirs, foreach=False, **kwargs)
    for _ in range(100):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        err = float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())
        assert err < 1e-6, f"shape {tuple(a.shape)}: relative error {err:.2e}"


def test_naive_adam_validates_its_hyperparameters():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="betas"):
        Adam(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="eps"):
        Adam(p, eps=0.0)


def test_ledger_measures_a_plain_pytorch_training_setup():
    model = TinyGPT("nano")
    opt = torch.optim.Adam(model.parameters())
    x = torch.randint(0, 256, (2, 16))
    lm_loss(model(x), x).backward()
    opt.step()
    measured = MemoryLedger.from_torch(model, opt).measure()
    # Plain fp32 training: 4 bytes each of weight, gradient, exp_avg and exp_avg_sq; the tied head counts once.
    assert measured.bytes == estimate_model_states(model.cfg.num_params(), precision="fp32").bytes


@pytest.mark.parametrize(
    ("moments", "per_moment"), [("fp32", 4 * 1000), ("bf16", 2 * 1000), ("int8", 1000 + 4)]
)
def test_moments_below_fp32_shrink_exp_avg_and_exp_avg_sq_only(moments, per_moment):
    base = estimate_model_states(2000, stage=2, world_size=2, offload_optimizer="cpu")
    low = estimate_model_states(2000, stage=2, world_size=2, offload_optimizer="cpu", moments=moments)
    for state in ("exp_avg", "exp_avg_sq"):  # a shard of 1000: one block of 2048, one scale
        assert low.bytes[state] == {"device": 0, "host": per_moment, "nvme": 0}
    for state in ("parameters", "gradients", "master_weights"):
        assert low.bytes[state] == base.bytes[state]
    with pytest.raises(ValueError, match="moments"):
        estimate_model_states(10, moments="int4")


def test_estimate_rejects_impossible_combinations():
    with pytest.raises(ValueError, match="stage 3"):
        estimate_model_states(10, stage=2, offload_param="cpu")
    with pytest.raises(ValueError, match="stage >= 1"):
        estimate_model_states(10, stage=0, offload_optimizer="cpu")
    with pytest.raises(ValueError, match="precision"):
        estimate_model_states(10, precision="fp8")


def test_the_one_pass_kernel_takes_module_1s_hyperparameters():
    """Module 4's C Adam is module 1's update in one pass: the same hyperparameters, by the same names and with
    the same defaults, so a call moves from one to the other unchanged (the kernel adds only its own options)."""
    from zero_offload.basics import adam_update
    from zero_offload.tuning import cpu_adam_update

    def keywords(fn):
        return {
            name: p.default
            for name, p in inspect.signature(fn).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }

    ours, kernel = keywords(adam_update), keywords(cpu_adam_update)
    assert {name: kernel.get(name, "missing") for name in ours} == ours
    positional = [
        n for n, p in inspect.signature(adam_update).parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD
    ]
    assert positional == ["param", "grad", "exp_avg", "exp_avg_sq"]
    assert list(inspect.signature(cpu_adam_update).parameters)[:4] == positional
