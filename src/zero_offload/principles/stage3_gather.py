"""ZeRO-3's weights on demand: a unit is gathered just before it is used, released right after, and the units
that come next are prefetched in the order the first pass showed.

At stage 3 ShardedStates (zero.py) owns one `UnitGathering` as `states.gathering`; the hooks that say when a
unit is needed (stage3_params.py) call it. The gathering keeps the order, the cursor and which units are held;
how a unit's buffer is filled it is told: the all-gather in zero.py (`ShardedStates._start_gather`, Lab 2.4),
or module 3's, which first uploads the host's shard on a stream of its own (offload.py). At stages 1 and 2
every rank always holds the full weights: there is no gathering, and `states.gathered` only adopts edits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..accelerator import Accelerator
from .comm import Comm
from .partition import Unit
from .stage3_leaves import GatherOrderError, find_leaf_modules, order_problem
from .stage3_params import ParameterAccess

END_OF_PASS = -1  # what a rank that has reached the end of a pass tells the others it gathers next


class UnitGathering:
    """Stage 3's gather, prefetch and release of units, for the states that own it.

    `start_gather(index, async_op=...)` fills unit `index`'s full buffer and marks it gathered (returning a
    handle to wait on when `async_op`); `after_gather(index)`, if given, is told when the unit's gather has
    landed or been given up, so whatever that gather read may go; `adopt(indices, rank)` makes what `rank`
    wrote into the full weights of `indices` everyone's (gathered_parameters(modifier_rank=...))."""

    def __init__(
        self,
        units: list[Unit],
        accel: Accelerator,
        comm: Comm,
        full_params: list[torch.Tensor],
        *,
        prefetch_numel: int,
        start_gather: Callable[..., object],
        adopt: Callable[[list[int], int], None],
        after_gather: Callable[[int], None] | None = None,
    ):
        self.units, self.accel, self.comm, self.full_params = units, accel, comm, full_params
        self.prefetch_numel = prefetch_numel
        self._start_gather, self._after_gather = start_gather, after_gather
        self.adopt_full_weights = adopt
        self._order = {"forward": [], "backward": []}  # units in the order the first pass of each used them
        self._recorded = {"forward": False, "backward": False}
        self._phase, self._cursor = "forward", -1
        self.held: set[int] = set()  # units gathered_parameters() keeps gathered
        self.access = None  # stage3_params.ParameterAccess, once install_hooks has run

    def install_hooks(self, model: torch.nn.Module, leaf_config, unit_of: dict[int, tuple[int, int]]) -> None:
        """Gather each module's units before its forward and backward, release them after (stage3_params.py
        also covers the reads of a parameter outside its own module's forward); a leaf module's whole subtree
        at once (stage3_leaves.py)."""
        leaves = find_leaf_modules(model, leaf_config)
        self.access = ParameterAccess(self, model, unit_of, leaves)

    def _agree_on_unit(self, index: int) -> None:
        """Before a collective fills unit `index` (or, END_OF_PASS, when a pass ends): every rank must be at the
        same unit, or the collective would pair one unit's shards with another's. One small all-gather of the
        unit numbers; at the first difference every rank raises, before any weights are mixed."""
        wanted = self.comm.gather_ints(index)
        if len(set(wanted)) > 1:
            phase = "backward" if self.in_backward else "forward"
            raise GatherOrderError(
                order_problem(phase, wanted, self.units, self.access.running_modules(), self.access.names)
            )

    @property
    def in_backward(self) -> bool:
        return self._phase == "backward"

    def gather(self, index: int, *, prefetch: bool = True) -> None:
        """Make unit `index`'s full weights present (waiting for its prefetch, if any); prefetch what follows
        (not outside a pass: reading weights for a state_dict says nothing about the order of the next one)."""
        unit = self.units[index]
        if unit.pending is not None:
            unit.pending.wait()
            unit.pending = None
        elif not unit.gathered:
            self._agree_on_unit(index)
            self._start_gather(index, async_op=False)
        if prefetch:
            self._prefetch_after(index)
        if self._after_gather is not None:
            self._after_gather(index)

    def _prefetch_after(self, index: int) -> None:
        """Start the all-gathers of the units that come next, up to `stage3_prefetch_bucket_size` elements ahead.

        The order of each phase is the one its first pass used (forward and backward differ: backward starts
        with the output head, which gathers the tied embedding); while a phase is being recorded nothing is
        prefetched. Only units beyond the furthest one reached are fetched, so a unit used twice does not
        fetch its successors twice.
        """
        order = self._order[self._phase]
        if not self._recorded[self._phase]:
            if index not in order:
                order.append(index)
            return
        if index not in order:
            return
        position = order.index(index)
        if position <= self._cursor:
            return
        self._cursor, budget = position, self.prefetch_numel
        for nxt in order[position + 1 :]:
            budget -= self.units[nxt].padded_numel
            if budget < 0:
                break
            if not self.units[nxt].gathered:
                self._agree_on_unit(nxt)
                self.units[nxt].pending = self._start_gather(nxt, async_op=True)

    def release(self, index: int) -> None:
        self._release(index)
        if self._after_gather is not None:
            self._after_gather(index)

    def _release(self, index: int) -> None:
        if index in self.held:  # inside gathered_parameters(): kept until the block ends
            return
        unit = self.units[index]
        if unit.pending is not None:  # a prefetch still writing into the buffer: let it land first
            unit.pending.wait()
            unit.pending = None
        if unit.gathered:
            self.accel.free_storage(self.full_params[index])
            unit.gathered = False

    def begin_phase(self, phase: str) -> None:
        """A forward or a backward starts: the pass that ends here has shown its order."""
        # A rank still gathering for the pass that ends here would otherwise hang on it.
        self._agree_on_unit(END_OF_PASS)
        if self._order[self._phase]:
            self._recorded[self._phase] = True
        for index in range(len(self.units)):
            self.release(index)  # a prefetch the pass did not use
        self._phase, self._cursor = phase, -1
        self.access.begin_phase(phase)
