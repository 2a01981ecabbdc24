"""The NVMe tier: the fp32 optimizer states live in files, and only a few sub-groups in host memory at a time.

With `"offload_optimizer": {"device": "nvme", "nvme_path": DIR}` this rank's optimizer partition (fp32 master
weights, Adam's m and v: 12 bytes a parameter; 8 or 6 with module 4's bf16 or 8-bit moments) leaves host memory
for three files per sub-group under DIR/zero_offload_rank<R>/ (five with 8-bit moments: their block scales).
The host keeps the fp32 gradient partition, the staging buffers publish() uploads, and `buffer_count` slots,
each the size of the largest sub-group.

Sub-groups are whole units (the parameters of one module, principles/partition.py) packed in model order up to
`sub_group_size` elements; a unit larger than that is a sub-group of its own. Whole units keep the step bit for
bit the CPU tier's: Adam runs over the same tensors, one call per unit, with the same step count.

One step, for sub-groups g = 0, 1, ... (slot of g: g % B, with B slots):

    reader thread   read g+1 .. g+B-1 ahead into their slots, each after its slot's last write has finished
    main thread     wait for g's read; Adam on g's units with their gradient slices (the gradient partition
                    stays in RAM); the new weights rounded into the staging buffers
    writer thread   write g behind into temporary files beside its files, flushed to the drive (fsync)

Only once every rank has written every sub-group does each temporary file replace its file (os.replace), so
the files move from step k-1 to step k together. If a read or a write fails on any rank, no file is replaced:
the temporaries are removed, Adam's step counts are rolled back, the staging buffers are rounded again from the
files, and the step raises NVMeError on every rank. The engine is then where it was before the step (its
global_steps, loss scale and schedule had not moved yet); only that step's gradients are still accumulated:
call engine.zero_grad(), free space, and train on.

The slots and the files are `NVMeSlots`, the part OffloadedStates is given in place of the host's in-memory
optimizer states (implementation/host_buffers.py); NVMeStates moves the sub-groups through them. The files
themselves, their lock and their checksums are nvme_files.py's: this process's scratch space, and no one
else's; a file changed underneath raises instead of being trained on.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

from ..accelerator import Accelerator
from ..basics.memory import MOMENT_DTYPES, moment_scales
from ..implementation.offload import OffloadedStates
from ..implementation.transfers import host_buffer
from ..implementation.updaters import Update
from ..principles.comm import Comm
from ..principles.device_buffers import split_flat
from ..principles.zero import fill_shard
from .nvme_files import STATES, NVMeError, NVMePathError, SwapFiles, os_error

__all__ = ["STATES", "NVMeError", "NVMePathError", "NVMeSlots", "NVMeStates", "SwapFiles", "sub_groups"]

# The memory report's name for each file's state: a moment's block scales are part of it.
_LEDGER_NAMES = {
    "master": "master_weights",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
    "exp_avg_scale": "exp_avg",
    "exp_avg_sq_scale": "exp_avg_sq",
}
SCALE_STATES = ("exp_avg_scale", "exp_avg_sq_scale")


def sub_groups(sizes: list[int], limit: int) -> list[range]:
    """Consecutive units packed up to `limit` elements each; a unit above the limit is a group of its own."""
    groups, start, total = [], 0, 0
    for index, size in enumerate(sizes):
        if index > start and total + size > limit:
            groups.append(range(start, index))
            start, total = index, 0
        total += size
    groups.append(range(start, len(sizes)))
    return groups


def _timed(fn, *args):
    start = time.perf_counter()
    return fn(*args), start, time.perf_counter()


def agree_on_files(comm: Comm, error: Exception | None) -> None:
    """Raise on every rank if any rank could not use its swap files (`error`: this rank's, or None)."""
    elsewhere = NVMeError("another rank could not use its NVMe swap files; see that rank's error")
    comm.raise_together(error, elsewhere)


class NVMeSlots:
    """This rank's fp32 master, m and v for the NVMe tier: `buffer_count` host slots, each the size of the
    largest sub-group, and the files every sub-group lives in between steps.

    The same shape as host_buffers.HostOptimizerStates (flat `master`, `exp_avg`, `exp_avg_sq`, per-unit views
    `master_params`, `exp_avgs`, `exp_avg_sqs`), except that the views of sub-group g are valid only while g is
    in its slot. The files are prepared here, on every rank together; if any rank fails, none keeps its files."""

    masters_stay_in_memory = False  # each master leaves its slot: publish() uploads from a staging copy

    def __init__(
        self,
        sizes: list[int],
        accel: Accelerator,
        comm: Comm,
        *,
        nvme_path,
        buffer_count: int,
        sub_group_size: int,
        pin: bool,
        moments: str = "fp32",
    ):
        self.groups = sub_groups(sizes, sub_group_size)
        m_dtype, v_dtype = MOMENT_DTYPES[moments]
        # Each state's elements per unit: module 4's 8-bit moments add one fp32 scale per block of each unit.
        scales = [moment_scales(size, moments) for size in sizes]
        layout = {
            "master": (torch.float32, sizes),
            "exp_avg": (m_dtype, sizes),
            "exp_avg_sq": (v_dtype, sizes),
        }
        if sum(scales):
            layout.update({key: (torch.float32, scales) for key in SCALE_STATES})
        self.states = tuple(layout)
        per_group = {key: [sum(n[i] for i in g) for g in self.groups] for key, (_, n) in layout.items()}
        self.files = SwapFiles(
            nvme_path,
            comm.rank,
            {key: [n * layout[key][0].itemsize for n in numels] for key, numels in per_group.items()},
        )
        error = None
        try:
            self.files.prepare()
        except NVMeError as err:
            error = err
        try:
            agree_on_files(comm, error)
        except NVMeError:
            self.files.remove()  # these states will not exist: nothing would close them
            raise
        self.slots = min(buffer_count, len(self.groups))
        self.slot_numel = max(per_group["master"])
        # One flat buffer per state, cut into slots: what the ledger counts as host memory for the states.
        self.flat = {}
        self.group_views = []  # per sub-group: its range of each state's slot, in the order of self.states
        for key, (dtype, _) in layout.items():
            self.flat[key] = host_buffer(accel, self.slots * max(per_group[key]), dtype, pin=pin)
        self.master, self.exp_avg, self.exp_avg_sq = (self.flat[key] for key in STATES)
        units = {key: [] for key in layout}  # per state, each unit's view
        for g, group in enumerate(self.groups):
            views = []
            for key, (_, numels) in layout.items():
                base, numel = (g % self.slots) * max(per_group[key]), per_group[key][g]
                views.append(self.flat[key][base : base + numel])
                units[key].extend(split_flat(views[-1], [numels[i] for i in group]))
            self.group_views.append(views)
        self.master_params, self.exp_avgs, self.exp_avg_sqs = (units[key] for key in STATES)
        none = [None] * len(sizes)
        self.exp_avg_scales, self.exp_avg_sq_scales = (units.get(key, none) for key in SCALE_STATES)

    def record(self, ledger) -> None:
        for key, flat in self.flat.items():  # the slots count as host memory for master, m and v
            ledger.record(_LEDGER_NAMES[key], flat)
        for g in range(len(self.groups)):
            for key in self.states:
                ledger.record_file(_LEDGER_NAMES[key], self.files.path(g, key))


class NVMeStates(OffloadedStates):
    """OffloadedStates whose fp32 master weights and moments live in files, sub-group by sub-group.

    master_params, exp_avgs and exp_avg_sqs are views into the slots (`self.swap`, an NVMeSlots): those of
    sub-group g are valid only while g is in its slot (during step(), or each_unit()). The staging buffers
    always hold the rounded master weights.
    """

    def __init__(self, model, accel, precision, stage, comm, zero, **kwargs):
        options = zero.offload_optimizer
        swap = functools.partial(
            NVMeSlots,
            accel=accel,
            comm=comm,
            nvme_path=options.nvme_path,
            buffer_count=options.buffer_count,
            sub_group_size=zero.sub_group_size,
            pin=options.pin_memory,
            moments=kwargs.get("moments", "fp32"),  # module 4: m and v in fp32, bf16 or 8 bits
        )
        # The model's fp32 values, kept until the files hold them (ShardedStates rebinds the parameters).
        initial = {id(p): p.detach() for p in model.parameters()}
        # The whole partition is on the host: the engine refuses a partial offload to NVMe.
        super().__init__(model, accel, precision, stage, comm, zero, host_optimizer=swap, **kwargs)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="zo-nvme-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="zo-nvme-write")
        self.swap = self.buffers.optimizer
        # What the step, each_unit() and the memory report walk: the sub-groups (units) and their files.
        self.groups, self.files = self.swap.groups, self.swap.files
        self._write_initial([[initial[id(p)] for p in unit.params] for unit in self.units])

    def close(self) -> None:
        """Finish the reads and writes in flight, stop their threads, and remove the files (engine.close())."""
        super().close()
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self.files.remove()

    def adopt_full_weights(self, indices, source_rank: int) -> None:
        raise NotImplementedError(
            "gathered_parameters(modifier_rank=...) cannot write into the fp32 masters of the NVMe tier, which "
            "live in files; edit the weights before zo.initialize, or load them with engine.load_checkpoint"
        )

    @torch.no_grad()
    def _write_initial(self, values: list[list[torch.Tensor]]) -> None:
        """Each sub-group's masters from the model's fp32 `values` (per unit), zero moments, into its files; the
        weights forward reads were already rounded from them, one unit at a time, as the states set up."""
        error = None
        try:
            for g, group in enumerate(self.groups):
                for index in group:
                    fill_shard(values[index], self.units[index], self.master_params[index])
                    for moment in (
                        self.exp_avgs,
                        self.exp_avg_sqs,
                        self.exp_avg_scales,
                        self.exp_avg_sq_scales,
                    ):
                        if moment[index] is not None:  # zero codes with zero scales: zero moments
                            moment[index].zero_()
                self._round(group)
                self.files.commit(self._write_group(g))
        except NVMeError as err:
            error = err
        try:
            agree_on_files(self.comm, error)
        except NVMeError:
            self.files.remove()
            raise

    # -- moving sub-groups ----------------------------------------------------------------------------------
    def _read_group(self, g: int) -> None:
        for state, view in zip(self.swap.states, self.swap.group_views[g], strict=True):
            try:
                self.files.read(g, state, view)
            except OSError as err:
                raise os_error(err, "read", self.files.path(g, state)) from None

    def _write_group(self, g: int) -> list[tuple[Path, Path, int]]:
        written = []
        try:
            for state, view in zip(self.swap.states, self.swap.group_views[g], strict=True):
                written.append(self.files.write(g, state, view))
        except BaseException as err:
            self.files.discard(written)
            if isinstance(err, OSError):
                raise os_error(err, "write", self.files.path(g, state)) from None
            raise
        return written

    def _read_after(self, g: int, pending_write):
        if pending_write is not None:  # never overwrite a slot whose last sub-group is still being written
            wait([pending_write])
        return _timed(self._read_group, g)

    def _round(self, group: range) -> None:
        for index in group:
            self.param_staging[index].copy_(self.master_params[index])

    # -- the step -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, host_adam, grads: list[torch.Tensor], clip_factor: float) -> None:
        """Adam over the whole partition, sub-group by sub-group, with reads ahead and writes behind."""
        optimizer = host_adam.optimizer
        counts = [optimizer.state[master]["step"].clone() for master in self.master_params]
        slots = self.swap.slots
        reads, writes, last_write, error = [], [], [None] * slots, None
        try:
            for g, group in enumerate(self.groups):
                # The slots of g .. g+B-1 last held g-B .. g-1, whose writes have all been queued by now.
                while len(reads) < min(g + slots, len(self.groups)):
                    ahead = len(reads)
                    reads.append(self._reader.submit(self._read_after, ahead, last_write[ahead % slots]))
                reads[g].result()
                host_adam.step(self, grads, clip_factor, units=group)
                if not host_adam.rounds_in_pass:  # module 4's C Adam rounds into the staging buffers itself
                    self._round(group)
                last_write[g % slots] = self._writer.submit(_timed, self._write_group, g)
                writes.append(last_write[g % slots])
        except Exception as err:
            error = err
        written, io_error = self._drain(reads, writes)
        try:
            agree_on_files(self.comm, error or io_error)
        except Exception as failure:
            self.files.discard(written)
            for master, count in zip(self.master_params, counts, strict=True):
                optimizer.state[master]["step"].copy_(count)
            try:
                for g, group in enumerate(self.groups):  # the weights of the last good step, from its files
                    self._read_group(g)
                    self._round(group)
            except NVMeError as err:
                raise NVMeError(
                    f"{failure}. Then the last good weights could not be read back ({err}): load a checkpoint"
                ) from failure
            if isinstance(failure, NVMeError):
                raise NVMeError(
                    f"{failure}. This step was not taken: the swap files and the weights hold the last good "
                    "one; engine.zero_grad() drops its gradients, and training can go on once this is fixed"
                ) from None
            raise
        self.files.commit(written)

    def _drain(self, reads, writes) -> tuple[list, Exception | None]:
        """Wait for every read and write this step started; their files, spans and first error."""
        written, error, timeline = [], None, self.transfers.timeline
        for stage, futures in (("NVMe read", reads), ("NVMe write", writes)):
            for future in futures:
                try:
                    result, start, end = future.result()
                except Exception as err:
                    error = error or err
                    continue
                if stage == "NVMe write":
                    written.extend(result)
                if timeline is not None:  # spans are added here, on the main thread, never by the workers
                    timeline.add(stage, start, end)
        return written, error

    def each_unit(self, *, write: bool = False):
        """Each unit's index, with its sub-group in its slot meanwhile (for checkpoints): read from the files,
        or with `write`, written back once the caller has filled all its units (and rounded for publish())."""
        for g, group in enumerate(self.groups):
            if not write:
                self._read_group(g)
            yield from group
            if write:
                self._round(group)
                self.files.commit(self._write_group(g))

    def publish(self, *, rounded: bool = True) -> None:
        # The staging buffers always hold the rounded masters (step() and each_unit() round each sub-group
        # before it leaves its slot): whatever the caller was told, they only need the upload.
        super().publish(rounded=True)


class NVMeUpdater:
    """The NVMe tier's Adam at the step: the partition read from its files a sub-group at a time."""

    norm_in_adam = False  # the sub-groups are stepped as they arrive; the norm is taken before

    def __init__(self, states: NVMeStates, adam, *, timeline):
        self.states, self.adam, self.timeline = states, adam, timeline

    def update(self, grads: list[torch.Tensor], clip_factor: float, norms=None) -> Update:
        with self.timeline.adam() as clock:
            self.states.step(self.adam, grads, clip_factor)
        return Update(clock.seconds, rounded=True)  # each sub-group was rounded before it left its slot
