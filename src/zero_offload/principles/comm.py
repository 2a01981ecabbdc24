"""The collectives ZeRO needs, on torch.distributed, with every element they move counted.

Counting follows the ZeRO paper's convention: a reduce-scatter or all-gather over a buffer of P elements moves
P elements per rank (a ring really sends (N-1)/N of that). Per optimizer step that gives 2P for stages 1 and 2
(reduce-scatter the gradients, all-gather the weights) and 3P for stage 3 (the weights are gathered twice: for
forward and again for backward). Small control messages (the overflow flag, the gradient norm) are counted apart.

With one process there is nobody to talk to: the collectives become local copies and count nothing.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
import torch.distributed as dist


class Comm:
    def __init__(self, group=None, *, timeline=None):
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        # Control messages live where the backend can send them: NCCL only moves CUDA tensors.
        nccl = self.distributed and dist.get_backend(group) == "nccl"
        self.control_device = (
            torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        )
        self.elements: Counter[str] = Counter()  # collective name -> elements moved (per rank)
        self.timeline = timeline  # module 5's practice.timeline.Timeline, when the engine keeps one
        # gloo's worker threads let go of a finished collective's tensors a moment late (see _Released).
        self._settle = self.distributed and dist.get_backend(group) == "gloo" and _CAN_COUNT_USES

    def _run(self, name: str, numel: int, op, async_op: bool, stage: str | None = None, tensors=()):
        """Run collective `op` on `tensors`, count its elements and, when a timeline is kept, record it as
        `stage`. On gloo it is complete only once gloo holds none of `tensors` any more."""
        self.elements[name] += numel
        start = self._mark(stage)
        held = [(t, t._use_count()) for t in tensors] if self._settle else []
        try:
            work = op(async_op)
        except RuntimeError as err:
            raise CommunicationError(f"{name} of {numel} elements failed on rank {self.rank}: {err}") from err
        if held and work is None:
            _until_released(held)
        elif held:
            work = _Released(work, held)
        if self.timeline is None or stage is None:  # control messages are too small to draw
            return work
        return self.timeline.until_done(stage, start, work)

    def _mark(self, stage: str | None):
        """Where `stage`'s span starts (on CUDA, an event on the current stream), or None if nothing records it."""
        return self.timeline.mark(stage) if self.timeline is not None and stage is not None else None

    def _local(self, stage: str, start: float | torch.cuda.Event) -> None:
        """One process: the collective was a local copy, recorded like one that ran synchronously."""
        if self.timeline is not None:
            self.timeline.until_done(stage, start, None)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, *, async_op: bool = False):
        """Sum `full` over ranks; rank r receives chunk r of the sum in `out`."""
        _check_writable(out, "reduce_scatter output")
        if self.world_size == 1:
            start = self._mark("reduce")
            out.copy_(full)
            return self._local("reduce", start)
        return self._run(
            "reduce_scatter",
            full.numel(),
            lambda a: _collective("reduce_scatter")(out, full, group=self.group, async_op=a),
            async_op,
            "reduce",
            (out, full),
        )

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False):
        """Every rank's `shard`, concatenated in rank order into `full` on every rank."""
        _check_writable(full, "all_gather output")
        if self.world_size == 1:
            if full.data_ptr() == shard.data_ptr():
                return None  # the shard is the whole buffer: nothing to gather, nothing to record
            start = self._mark("all-gather")
            full.copy_(shard)
            return self._local("all-gather", start)
        return self._run(
            "all_gather",
            full.numel(),
            lambda a: _collective("all_gather")(full, shard, group=self.group, async_op=a),
            async_op,
            "all-gather",
            (full, shard),
        )

    def all_reduce(self, tensor: torch.Tensor, *, async_op: bool = False):
        """Sum `tensor` over ranks, in place (data-parallel gradients at stage 0)."""
        if self.world_size == 1:
            return None
        return self._run(
            "all_reduce",
            tensor.numel(),
            lambda a: dist.all_reduce(tensor, group=self.group, async_op=a),
            async_op,
            "reduce",
            (tensor,),
        )

    def broadcast(self, tensor: torch.Tensor, source_rank: int) -> None:
        """`source_rank`'s `tensor` on every rank, in place (weights a user edited on one rank)."""
        if self.world_size == 1:
            return
        self._run(
            "broadcast",
            tensor.numel(),
            lambda a: dist.broadcast(tensor, source_rank, group=self.group, async_op=a),
            False,
            tensors=(tensor,),
        )

    def sum(self, value: float) -> float:
        """A float summed over ranks (a control message: the squared gradient norm)."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.control_device)
        self._run(
            "control",
            1,
            lambda a: dist.all_reduce(tensor, group=self.group, async_op=a),
            False,
            tensors=(tensor,),
        )
        return float(tensor)

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any rank: one rank's overflow skips the step everywhere."""
        if self.world_size == 1:
            return flag
        tensor = torch.tensor([1.0 if flag else 0.0], device=self.control_device)
        self._run(
            "control",
            1,
            lambda a: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=a),
            False,
            tensors=(tensor,),
        )
        return bool(tensor.item() > 0)

    def gather_ints(self, value: int) -> list[int]:
        """Every rank's `value`, in rank order (a control message: which unit each rank gathers next)."""
        if self.world_size == 1:
            return [value]
        mine = torch.tensor([value], dtype=torch.int64, device=self.control_device)
        every = torch.empty(self.world_size, dtype=torch.int64, device=self.control_device)
        self._run(
            "gather_order",  # counted apart: one per stage-3 gather, where the other control messages are per step
            1,
            lambda a: _collective("all_gather")(every, mine, group=self.group, async_op=a),
            False,
            tensors=(every, mine),
        )
        return every.tolist()

    def raise_together(self, error: BaseException | None, elsewhere: BaseException) -> None:
        """Raise on every rank if any rank failed: `error` where it happened, `elsewhere` on the others. A rank
        raising alone would leave the others waiting for it in their next collective."""
        if self.any(error is not None):
            raise error if error is not None else elsewhere

    def check_same(
        self,
        what: str,
        value: str,
        fix: str = "Every rank must load the same config file (compare with `zo check-config FILE --world-size N`).",
    ) -> None:
        """Fail on every rank, naming the ranks that differ and saying `fix`, unless every rank holds `value`."""
        if self.world_size == 1:
            return
        values = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        if len(set(values)) > 1:
            groups = {}
            for rank, v in enumerate(values):
                groups.setdefault(v, []).append(rank)
            listing = "; ".join(f"ranks {r} have {v[:12]}" for v, r in groups.items())
            raise ValueError(f"the ranks were started with different {what}: {listing}. {fix}")


# The single-tensor collectives by their newest names (torch 2.13), then the names older releases have (2.1 to
# 2.12): a GPU machine's own torch may be older than the one this project pins.
_COLLECTIVE_NAMES = {
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
    "all_gather": ("all_gather_single", "all_gather_into_tensor"),
}


def _collective(kind: str):
    for name in _COLLECTIVE_NAMES[kind]:
        found = getattr(dist, name, None)
        if found is not None:
            return found
    raise CommunicationError(
        f"this torch ({torch.__version__}) has none of torch.distributed.{' / '.join(_COLLECTIVE_NAMES[kind])}; "
        "zero_offload needs torch 2.1 or newer"
    )


# A tensor's C++ reference count, which counts gloo's hold on it (private API: without it, nothing is awaited).
_CAN_COUNT_USES = hasattr(torch.Tensor, "_use_count")
_RELEASE_LIMIT_S = 1.0


class _Released:
    """A gloo collective's handle whose wait() returns once gloo has let go of the collective's tensors.

    A gloo worker thread drops its reference to a collective a moment after waking whoever waits for it. If the
    last Python reference to one of the tensors is gone by then, the worker frees the tensor's Python object
    itself, and that takes the GIL. A thread that asks for the GIL after the interpreter has begun to shut down
    is ended by CPython with pthread_exit, which cannot unwind through the C++ destructor it is in: std::terminate,
    "terminate called without an active exception" and SIGABRT, after the script's last line had run. Once every
    tensor's reference count is back where it was before the collective, the tensors die on the caller's thread.
    """

    def __init__(self, work, held: list):
        self.work, self.held = work, held

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None  # the handle's own reference to gloo's work, and through it to the tensors
            _until_released(self.held)
            self.held = []
        return True


def _until_released(held: list) -> None:
    """Wait until gloo holds none of the tensors in `held` ((tensor, reference count before the collective)).
    Usually it is so already; if something else keeps a tensor, give up after a second rather than hang."""
    deadline = None
    while any(tensor._use_count() > count for tensor, count in held):
        deadline = deadline or time.monotonic() + _RELEASE_LIMIT_S
        if time.monotonic() > deadline:
            return
        time.sleep(50e-6)  # the worker needs a core, not the GIL: the tensors' Python objects are alive


def _check_writable(tensor: torch.Tensor, what: str) -> None:
    # A ZeRO-3 buffer whose storage was freed still has its shape; writing into it would corrupt memory.
    needed = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    if tensor.untyped_storage().nbytes() < needed:
        raise RuntimeError(
            f"the {what} has no memory behind it ({tensor.untyped_storage().nbytes()} of {needed} bytes): "
            "its storage was freed; restore it (accelerator.restore_storage) before writing into it"
        )


class CommunicationError(RuntimeError):
    """A collective failed: usually another rank died or timed out."""
