"""ZeRO-3's weights on demand: a unit is gathered just before it is used, released right after, and the units
that come next are prefetched in the order the first pass showed.

zero.py's ShardedStates inherits this. The collective that fills a unit's buffer (`_start_gather`, Lab 2.4)
stays in zero.py with the other collectives; the hooks that say when a unit is needed are in stage3_params.py.
At stages 1 and 2 every rank always holds the full weights: there only `gathered` and `adopt_full_weights`
do anything.
"""

from __future__ import annotations

import contextlib

import torch

from .stage3_leaves import GatherOrderError, find_leaf_modules, order_problem
from .stage3_params import ParameterAccess

END_OF_PASS = -1  # what a rank that has reached the end of a pass tells the others it gathers next


class GatheredWeights:
    """Stage 3's gather, prefetch and release of units, for ShardedStates (which provides `units`, `accel`,
    `comm`, `stage`, the weight buffers and `_start_gather`)."""

    def _init_gathering(self, prefetch_numel: int) -> None:
        self.prefetch_numel = prefetch_numel
        self._order = {"forward": [], "backward": []}  # units in the order the first pass of each used them
        self._recorded = {"forward": False, "backward": False}
        self._phase, self._cursor = "forward", -1
        self.held: set[int] = set()  # units gathered_parameters() keeps gathered
        self.access = None  # stage 3: stage3_params.ParameterAccess

    def _install_gather_hooks(self, model: torch.nn.Module, leaf_config) -> None:
        """Gather each module's units before its forward and backward, release them after (stage3_params.py
        also covers the reads of a parameter outside its own module's forward); a leaf module's whole subtree
        at once (stage3_leaves.py)."""
        leaves = find_leaf_modules(model, leaf_config)
        self.access = ParameterAccess(self, model, self._unit_of, leaves)

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
        if index in self.held:  # inside gathered_parameters(): kept until the block ends
            return
        unit = self.units[index]
        if unit.pending is not None:  # a prefetch still writing into the buffer: let it land first
            unit.pending.wait()
            unit.pending = None
        if unit.gathered:
            self.accel.free_storage(self.full_params[index])
            unit.gathered = False

    def _begin_phase(self, phase: str) -> None:
        if self.stage == 3:
            # A rank still gathering for the pass that ends here would otherwise hang on it.
            self._agree_on_unit(END_OF_PASS)
            if self._order[self._phase]:
                self._recorded[self._phase] = True  # the pass that just ended has shown its order
            for index in range(len(self.units)):
                self.release(index)  # a prefetch the pass did not use
            self._phase, self._cursor = phase, -1
            self.access.begin_phase(phase)

    @contextlib.contextmanager
    def gathered(self, params=None, *, modifier_rank: int | None = None):
        """Full weights of `params` (default: all) until the block ends; with `modifier_rank`, what that rank
        wrote into them becomes every rank's weights and fp32 masters. Every rank must enter it."""
        if self.stage == 3:
            with self.access.gathered(params, modifier_rank=modifier_rank):
                yield
            return
        yield  # stages 1 and 2 always hold the full weights
        if modifier_rank is not None:
            self.adopt_full_weights(range(len(self.units)), modifier_rank)

    @torch.no_grad()
    def adopt_full_weights(self, indices, source_rank: int) -> None:
        """The full weights of units `indices` on `source_rank` become everyone's: weight shards and masters."""
        if not 0 <= source_rank < self.comm.world_size:
            raise ValueError(
                f"modifier_rank={source_rank} is not a rank of this job of {self.comm.world_size}"
            )
        for index in indices:
            full, layout = self.full_params[index], self.units[index].layout
            self.comm.broadcast(full, source_rank)
            shard = full[layout.start : layout.end]
            for target in (self.param_shards[index], self.master_params[index]):
                if target.data_ptr() != shard.data_ptr():
                    target.copy_(shard)
