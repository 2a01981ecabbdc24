"""Non-finite values never reach the master weights: a step that would apply them is skipped, and a run that
keeps skipping stops with an error instead of logging NaN for hours.

fp16 has had this rule from the start (basics/precision.py): an overflow skips the step and lowers the loss
scale, which is what makes the next step finite. bf16 and fp32 have fp32's exponent range and no scale to
lower, so an inf or a nan there is a real divergence (too high a learning rate, a bad batch, a bug), not a
matter of range. The engine skips such a step too (a non-finite loss before its backward, a non-finite
gradient norm before Adam), and this guard counts the skips that nothing can cure: every bf16/fp32 skip, and
an fp16 overflow only once the loss scale cannot go lower (a static scale, or a dynamic one at
min_loss_scale). A dynamic scale on its way down from too high a start skips many steps in a row by design.
After `zero_offload.max_skipped_steps` such skips in a row, TrainingDivergedError names the step, the scale
and the checkpoint to go back to.
"""

from __future__ import annotations

import warnings

import torch


class TrainingDivergedError(RuntimeError):
    """Training cannot usefully go on: too many steps in a row were skipped, or non-finite gradients were
    applied before they could be seen. The message names the step, why, and the last checkpoint."""


class SkipGuard:
    """Counts the skipped steps in a row that lowering the loss scale cannot cure, warns at each one, and
    stops the run at the `limit`-th."""

    def __init__(self, limit: int, *, fp16: bool):
        self.limit, self.fp16 = limit, fp16
        self.in_a_row = 0
        self.last_checkpoint: tuple[str, int] | None = None  # (path, step) of the last save or load
        self.window_skip: str | None = None  # why this accumulation window's step will be skipped

    def remember_checkpoint(self, path, step: int) -> None:
        """The run was saved to, or loaded from, `path` at `step`: what a diverged run is told to go back to."""
        self.last_checkpoint = (str(path), step)

    def resume(self, in_a_row: int) -> None:
        """Continue a run from a checkpoint that was saved after `in_a_row` skipped steps in a row."""
        self.in_a_row = in_a_row

    def skips_backward(self, loss: torch.Tensor, comm) -> bool:
        """bf16/fp32: whether this window's step is to be skipped for a non-finite loss on any rank. Its backward
        is skipped on every rank then (the collectives inside backward pair up), and so are the rest of the
        window's, so that no gradient, and no Adam the pipeline runs during backward, ever sees the inf or nan.

        fp16 is left to its overflow check after backward: there an inf loss is the scale's doing, and the
        skip is what lowers the scale. The check is one scalar (and a one-element collective) per micro-batch."""
        if self.fp16:
            return False
        if self.window_skip is None and comm.any(not bool(torch.isfinite(loss.detach()))):
            self.window_skip = "non-finite loss"
        return self.window_skip is not None

    def take_window_skip(self) -> str | None:
        """At the step: why the window that just closed is skipped (None: it is not); the next window starts clean."""
        skip, self.window_skip = self.window_skip, None
        return skip

    def after_step(self, step: int, skipped: str | None, scaler) -> TrainingDivergedError | None:
        """Step `step` (1-based: the engine's global_steps after it) was taken (`skipped` None) or skipped for
        the reason given. Call it before the scaler moves; the error it returns is raised by the caller once
        the step's bookkeeping is done, so that the engine stays consistent (a checkpoint can still be saved)."""
        curable = skipped == "fp16 overflow" and scaler.dynamic and scaler.scale > scaler.min_scale
        if skipped is None or curable:
            self.in_a_row = 0  # a lower scale is progress: the scaler has not run out of moves
            return None
        self.in_a_row += 1
        why = skipped + self._scale_note(scaler)
        if self.in_a_row >= self.limit:
            return TrainingDivergedError(
                f"training diverged: step {step} is the {_ordinal(self.in_a_row)} step in a row skipped ({why}); "
                f"nothing has been applied since step {step - self.in_a_row}, so the weights are still finite. "
                f"{self.checkpoint_note()} Lower the learning rate (or look for the batch or layer that "
                "produces the inf/nan) and resume from there; zero_offload.max_skipped_steps "
                f"(now {self.limit}) sets how many skipped steps in a row are tolerated."
            )
        warnings.warn(
            f"step {step} skipped ({why}): the master weights, moments and schedule are unchanged; "
            f"{self.in_a_row} in a row, training stops at {self.limit} (zero_offload.max_skipped_steps)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None

    def poisoned(self, step: int, norm: float, how: str) -> TrainingDivergedError:
        """The error for a non-finite gradient norm found only after Adam had applied those gradients."""
        return TrainingDivergedError(
            f"step {step}: the gradient norm is {norm} with a finite loss, and Adam had already applied these "
            f"gradients ({how}): the master weights and moments now hold non-finite values. "
            f"{self.checkpoint_note()} Resume from there with gradient_clipping set (e.g. 1.0): then the norm "
            "is checked before Adam runs, and such a step is skipped instead."
        )

    def checkpoint_note(self) -> str:
        if self.last_checkpoint is None:
            return "No checkpoint has been saved or loaded yet."
        path, step = self.last_checkpoint
        return f"The last checkpoint is {path} (step {step})."

    def _scale_note(self, scaler) -> str:
        if not self.fp16:
            return ""  # bf16 and fp32: no loss scaling
        if not scaler.dynamic:
            return f"; the static fp16 loss scale {scaler.scale:g} never moves"
        return f"; the fp16 loss scale {scaler.scale:g} sits at min_loss_scale and cannot go lower"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
