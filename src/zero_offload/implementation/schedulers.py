"""Learning-rate schedules, with the same numbers as DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR.

The three schedules of the DeepSpeed config's "scheduler" key:

- WarmupLR raises the learning rate from warmup_min_lr to warmup_max_lr over warmup_num_steps
  optimizer steps, then holds it at warmup_max_lr.
- WarmupDecayLR warms up the same way, then lowers the rate in a straight line back to
  warmup_min_lr (so to 0 with the default warmup_min_lr) at total_num_steps.
- WarmupCosineLR works in fractions of the optimizer's own lr: it warms up from
  warmup_min_ratio * lr to lr, then follows half a cosine down to cos_min_ratio * lr at total_num_steps.

Warmup is either "log" (fast at first, slow near the end: fraction log(i + 1) / log(warmup_num_steps))
or "linear" (fraction i / warmup_num_steps), with i DeepSpeed's last_batch_iteration (see Counting).

Why warm up at all? Adam divides each step by sqrt(v), its running average of squared gradients.
In the first steps v is built from a handful of gradients, so it can be far too small for some weights
and their steps come out huge. A small lr while v settles keeps those first, badly scaled steps from
throwing the model somewhere it cannot recover from; after a few hundred steps the full lr is safe.

Counting. DeepSpeed calls its position `last_batch_iteration`; it starts at -1 and each applied optimizer
step adds one, so while optimizer step n (0-based) runs it is n - 1. We keep that name, so that our
state dicts and DeepSpeed's hold the same number. Before any step DeepSpeed sets the lr to
warmup_min_lr (WarmupLR, WarmupDecayLR) or to 0 (WarmupCosineLR, whatever warmup_min_ratio says).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

# One table of parameter names and DeepSpeed's defaults, shared with the config parser.
from zero_offload.config import SCHEDULER_DEFAULTS, SchedulerConfig

__all__ = ["LRScheduler", "build_scheduler", "lr_at"]


def _checked(kind: str, params: Mapping) -> dict:
    if kind not in SCHEDULER_DEFAULTS:
        raise ValueError(f"unknown scheduler type {kind!r}; expected one of {', '.join(SCHEDULER_DEFAULTS)}")
    p = {**SCHEDULER_DEFAULTS[kind], **params}
    if "total_num_steps" in p and p["total_num_steps"] is None:
        raise ValueError(f"{kind} needs total_num_steps: the decay must know when training ends")
    return p


def _warmup_steps(p: Mapping) -> int:
    # DeepSpeed raises warmup_num_steps to at least 2 so that log(warmup_num_steps) is never 0.
    return max(2, p["warmup_num_steps"])


def _warmup_fraction(p: Mapping, it: int) -> float:
    """How far warmup has got, 0 to 1, when DeepSpeed's last_batch_iteration is `it` (0 <= it < warmup)."""
    if p["warmup_type"] == "log":
        # 1 at it = warmup - 1. Multiplying by 1/log(w), as DeepSpeed does, keeps our floats identical.
        return (1.0 / math.log(_warmup_steps(p))) * math.log(it + 1)
    return it / _warmup_steps(p)  # 1 only at it = warmup, one step later than log


def _cosine_ratio(p: Mapping, it: int) -> float:
    warmup, total = _warmup_steps(p), p["total_num_steps"]
    if it < 0:
        return 0.0  # DeepSpeed starts WarmupCosineLR at 0, not at warmup_min_ratio
    if it < warmup:
        low = p["warmup_min_ratio"]
        return low + _warmup_fraction(p, it) * (1.0 - low)
    # The cosine reaches its floor at it = total - 1 and stays there if training runs on, as DeepSpeed's does
    # since 0.19.8 (it clamps the progress to 1; before, the lr climbed back up past total_num_steps). With
    # total_num_steps <= warmup there is no decay to walk: every step after warmup is at the floor.
    progress = min(1.0, (it - warmup + 1) / max(1, total - warmup))
    angle = math.pi * progress
    floor = p["cos_min_ratio"]
    return max(0.0, floor + (1.0 - floor) * ((1 + math.cos(angle)) / 2))


def lr_at(kind: str, params: Mapping, step: int, base_lr: float) -> float:
    """The lr that optimizer step number `step` (0-based, applied steps only) uses under DeepSpeed.

    `params` are the scheduler's DeepSpeed params (missing ones take DeepSpeed's defaults); their
    last_batch_iteration is ignored, since `step` already says where in the schedule we are. `base_lr`
    is the optimizer's configured lr; only WarmupCosineLR uses it, the others work in absolute values.
    """
    p = _checked(kind, params)
    it = step - 1  # DeepSpeed's last_batch_iteration while this step runs
    if kind == "WarmupCosineLR":
        return base_lr * _cosine_ratio(p, it)
    low, high = p["warmup_min_lr"], p["warmup_max_lr"]
    if it < 0:
        return low
    if it < _warmup_steps(p):
        gamma = _warmup_fraction(p, it)
    elif kind == "WarmupDecayLR":
        total = p["total_num_steps"]
        gamma = max(0.0, (total - it) / max(1, total - _warmup_steps(p)))  # 0 from it = total on
    else:
        gamma = 1.0
    return low + (high - low) * gamma


class LRScheduler:
    """Writes the scheduled lr into every param group of `optimizer`; call step() after each applied step."""

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, params: Mapping):
        self.optimizer = optimizer
        self.kind = kind
        self.params = _checked(kind, params)
        # WarmupCosineLR scales each group's own lr, so remember them before we overwrite them.
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.last_batch_iteration = int(self.params["last_batch_iteration"])
        self._apply()

    @property
    def steps_applied(self) -> int:
        return self.last_batch_iteration + 1

    def _apply(self) -> None:
        # Unlike DeepSpeed, we also set the lr when resuming (last_batch_iteration >= 0) and after
        # load_state_dict; DeepSpeed leaves that to the restored optimizer state. Its cosine schedule
        # also sets only the first group before step 0; we set them all.
        self._last_lr = [lr_at(self.kind, self.params, self.steps_applied, base) for base in self.base_lrs]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr

    def step(self) -> None:
        """Advance past one applied optimizer step and set the lr for the next one.

        Call it only after steps the optimizer really applied. DeepSpeed's engine (`_take_model_step` in
        deepspeed/runtime/engine.py) steps its scheduler only when the fp16 optimizer reports no overflow,
        so a step skipped for an overflowing loss scale does not move the schedule either.
        """
        self.last_batch_iteration += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        """The lr of each param group, as set for the next optimizer step."""
        return list(self._last_lr)

    def state_dict(self) -> dict:
        # Plain ints and floats only, so a checkpoint loads with torch.load(weights_only=True).
        return {"last_batch_iteration": self.last_batch_iteration, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: Mapping) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        # A DeepSpeed state dict has no base_lrs; then the lrs seen at construction stand.
        self.base_lrs = [float(lr) for lr in state.get("base_lrs", self.base_lrs)]
        self._apply()


def build_scheduler(config: SchedulerConfig, optimizer: torch.optim.Optimizer) -> LRScheduler | None:
    """The scheduler a config's "scheduler" key asks for, or None when it has none."""
    if config.type is None:
        return None
    return LRScheduler(optimizer, config.type, config.params)
