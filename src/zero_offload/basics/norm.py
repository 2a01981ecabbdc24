"""The global gradient norm, computed one way at every stage: the clip factor and the reported norm.

Every stage sums the squares of the gradient pieces it holds with `squared_norm`; the sharded stages then add
the ranks' sums (`global_norm`). Module 4's C Adam sums the same rows in its own pass over the gradient
(`norm_rows`, `squared_norm_of_rows`), so that no separate pass has to read the gradient again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

NORM_ROW = 4096  # elements summed in fp32 before the float64 total (ZO_NORM_ROW in tuning/csrc/cpu_adam.h)


def squared_norm(grad: torch.Tensor) -> float:
    """A gradient shard's share of the squared global norm.

    Rows of 4096 elements are summed in fp32, the rows' squares in float64. Why not float64 throughout: it
    converts every element and costs ten times as much (60 ms for 10M elements on one core, half a training
    step here). Why rows: each row is reduced by one thread in a fixed order, so the result does not depend on
    the thread count or the tensor's address, and the serial step and module 5's pipeline (which computes it on
    another thread, from another buffer) agree bit for bit."""
    flat = grad.reshape(-1)
    whole = flat.numel() // NORM_ROW * NORM_ROW
    rows = torch.linalg.vector_norm(flat[:whole].view(-1, NORM_ROW), dim=1, dtype=torch.float32)
    tail = flat[whole:].to(torch.float64)
    return float(rows.to(torch.float64).square().sum()) + float(tail.square().sum())


def norm_rows(numel: int) -> int:
    """How many rows `row_squares` needs for a tensor of `numel` elements."""
    return -(-numel // NORM_ROW)


def squared_norm_of_rows(row_squares: torch.Tensor) -> float:
    """The squared norm from an update's row sums: added exactly (math.fsum), so in no order that could vary."""
    return math.fsum(row_squares.tolist())


def global_norm(squares: Iterable[float], sum_over_ranks: Callable[[float], float] = float) -> float:
    """The norm of the whole gradient from this rank's squared norms, one per piece it holds.

    The pieces of all ranks are disjoint and together make the whole gradient, so their squares add up to the
    square of its norm. `sum_over_ranks` is the collective that adds every rank's sum (`Comm.sum`); the default
    is for a gradient held whole."""
    return math.sqrt(sum_over_ranks(sum(squares)))
