"""Adam and AdamW written out step by step: the optimizer whose states ZeRO-Offload moves to the CPU.

For every parameter tensor, one step of Adam at step number t (counting from 1) does, in this order:

  1. weight decay, one of two kinds:
       Adam  (L2 regularisation):  g <- g + wd * p        the decay is part of the gradient, so it flows into m, v
       AdamW (decoupled decay):    p <- p * (1 - lr * wd)  the decay shrinks the weight directly, m, v never see it
  2. moments:                      m <- beta1 * m + (1 - beta1) * g
                                   v <- beta2 * v + (1 - beta2) * g * g
  3. bias correction:              m_hat = m / (1 - beta1^t),   v_hat = v / (1 - beta2^t)
  4. update:                       p <- p - lr * m_hat / (sqrt(v_hat) + eps)

Per parameter that is 4 bytes of fp32 weight, 4 of m and 4 of v kept between steps: the 12 bytes of
"optimizer states" that dominate mixed-precision memory (chapter 01). The arithmetic is tiny, the memory traffic
is not: Adam is memory-bound, which is why it can run on a CPU at all.
"""

from __future__ import annotations

import math

import torch


def update_moments(
    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, beta1: float, beta2: float
):
    """Step 2: move the running means m (exp_avg) and v (exp_avg_sq) towards g and g*g, in place."""
    # BEGIN LAB 1.1: update the first and second moments in place
    # m <- beta1 * m + (1 - beta1) * g        a running mean of the gradient (momentum)
    # v <- beta2 * v + (1 - beta2) * g * g    a running mean of the squared gradient
    # Update exp_avg and exp_avg_sq in place (mul_, add_, addcmul_): the optimizer keeps these very tensors.
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    # END LAB 1.1


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = False,
    bias_correction: bool = True,
) -> None:
    """One Adam (or AdamW) step for one tensor, in place; `step` counts from 1."""
    beta1, beta2 = betas
    # BEGIN LAB 1.2: weight decay (Adam vs AdamW), the moments, bias correction and the parameter update
    # Adam adds wd * p to the gradient before the moments; AdamW multiplies p by (1 - lr * wd) instead.
    # Then call update_moments(...), and apply p <- p - lr * m_hat / (sqrt(v_hat) + eps) where
    # m_hat = m / (1 - beta1**step) and v_hat = v / (1 - beta2**step) (both 1 if bias_correction is False).
    # Do not modify `grad` in place: it belongs to the caller.
    if weight_decay != 0:
        if adamw:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    update_moments(exp_avg, exp_avg_sq, grad, beta1, beta2)
    bias1 = 1 - beta1**step if bias_correction else 1.0
    bias2 = 1 - beta2**step if bias_correction else 1.0
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias1)
    # END LAB 1.2


class Adam(torch.optim.Optimizer):
    """A naive, readable Adam/AdamW: plain tensor ops, one parameter at a time.

    Matches `torch.optim.Adam` (and `torch.optim.AdamW` with `adamw=True`) to float rounding. It is slow on
    purpose: every line is a separate pass over memory, the cost module 4's one-pass C kernel removes.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, adamw=False):
        if not lr >= 0.0:
            raise ValueError(f"Adam: lr must be >= 0, got {lr}")
        if not eps > 0.0:
            raise ValueError(f"Adam: eps must be > 0, got {eps}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Adam: betas must be two numbers in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Adam: weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw=adamw)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("Adam does not support sparse gradients")
                state = self.state[param]
                if not state:
                    # Same state names as torch.optim.Adam, so state_dicts and the engine can share buffers.
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] += 1
                adam_update(
                    param,
                    param.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    step=int(state["step"].item()),
                    lr=group["lr"],
                    betas=group["betas"],
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    adamw=group["adamw"],
                )
        return loss
