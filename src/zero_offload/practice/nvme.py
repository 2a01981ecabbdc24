"""The NVMe tier: the fp32 optimizer states live in files, and only a few sub-groups in host memory at a time.

With `"offload_optimizer": {"device": "nvme", "nvme_path": DIR}` this rank's optimizer partition (fp32 master
weights, Adam's m and v: 12 bytes a parameter) leaves host memory for three files per sub-group under
DIR/zero_offload_rank<R>/. The host keeps the fp32 gradient partition, the staging buffers publish() uploads,
and `buffer_count` slots, each the size of the largest sub-group.

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

The files themselves, their lock and their checksums are nvme_files.py's: this process's scratch space, and no
one else's; a file changed underneath raises instead of being trained on.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

from ..implementation.offload import OffloadedStates
from ..implementation.updaters import Update
from ..principles.zero import fill_shard
from .nvme_files import STATES, NVMeError, NVMePathError, SwapFiles, os_error

__all__ = ["STATES", "NVMeError", "NVMePathError", "NVMeStates", "SwapFiles", "sub_groups"]

_LEDGER_NAMES = ("master_weights", "exp_avg", "exp_avg_sq")


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


class NVMeStates(OffloadedStates):
    """OffloadedStates whose fp32 master weights and moments live in files, sub-group by sub-group.

    master_params, exp_avgs and exp_avg_sqs are views into the slots: those of sub-group g are valid only while
    g is in its slot (during step(), or each_unit()). The staging buffers always hold the rounded master weights.
    """

    def __init__(self, model, accel, precision, stage, comm, zero, **kwargs):
        options = zero.offload_optimizer
        self.nvme_path, self.buffer_count = options.nvme_path, options.buffer_count
        self.sub_group_size = zero.sub_group_size
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="zo-nvme-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="zo-nvme-write")
        super().__init__(model, accel, precision, stage, comm, zero, **kwargs)

    def close(self) -> None:
        """Finish the reads and writes in flight, stop their threads, and remove the files (engine.close())."""
        super().close()
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        if hasattr(self, "files"):
            self.files.remove()

    def _agree(self, error: Exception | None) -> None:
        elsewhere = NVMeError("another rank could not use its NVMe swap files; see that rank's error")
        self.comm.raise_together(error, elsewhere)

    def adopt_full_weights(self, indices, source_rank: int) -> None:
        raise NotImplementedError(
            "gathered_parameters(modifier_rank=...) cannot write into the fp32 masters of the NVMe tier, which "
            "live in files; edit the weights before zo.initialize, or load them with engine.load_checkpoint"
        )

    def _allocate_optimizer_states(self, shard_numel: int) -> None:
        sizes, _ = self._placement()  # the whole partition: the engine refuses a partial offload to NVMe
        self.groups = sub_groups(sizes, self.sub_group_size)
        numels = [sum(sizes[i] for i in group) for group in self.groups]
        self.files = SwapFiles(self.nvme_path, self.comm.rank, numels)
        error = None
        try:
            self.files.prepare()
        except NVMeError as err:
            error = err
        try:
            self._agree(error)
        except NVMeError:
            self.files.remove()  # this engine will not exist: nothing would close it
            raise
        self.slots, self.slot_numel = min(self.buffer_count, len(self.groups)), max(numels)
        # One flat buffer per state, cut into slots: what the ledger counts as host memory for the states.
        flat = [self._host(self.slots * self.slot_numel, torch.float32, self.pin_optimizer) for _ in STATES]
        self.master, self.exp_avg, self.exp_avg_sq = flat
        self._group_views = []  # per sub-group: its range of each state's slot
        lists = self.master_params, self.exp_avgs, self.exp_avg_sqs = [], [], []
        for g, (group, numel) in enumerate(zip(self.groups, numels, strict=True)):
            base = (g % self.slots) * self.slot_numel
            views = [buffer[base : base + numel] for buffer in flat]
            self._group_views.append(views)
            for out, view in zip(lists, views, strict=True):
                out.extend(self._split(view, [sizes[i] for i in group]))
        self.device_master = None
        self.device_exp_avg = self.accel.zeros(0, torch.float32, category="optimizer_states")
        self.device_exp_avg_sq = self.accel.zeros(0, torch.float32, category="optimizer_states")
        # Even fp32 weights need their own staging buffer: the master they were rounded from leaves its slot.
        if self.offload_param:
            self.param_staging = self.param_shards
        else:
            self.param_staging = self._split(self._host(sum(sizes), self.dtype, self.pin_optimizer), sizes)

    @torch.no_grad()
    def _initialise(self, initial: list[torch.Tensor]) -> None:
        super()._initialise(initial)  # each unit passes through its slot into the weights forward reads
        values, start = [], 0
        for unit in self.units:
            values.append(initial[start : start + len(unit.params)])
            start += len(unit.params)
        error = None
        try:
            for g, group in enumerate(self.groups):
                for index in group:
                    fill_shard(values[index], self.units[index], self.master_params[index])
                    self.exp_avgs[index].zero_()
                    self.exp_avg_sqs[index].zero_()
                self._round(group)
                self.files.commit(self._write_group(g))
        except NVMeError as err:
            error = err
        try:
            self._agree(error)
        except NVMeError:
            self.files.remove()
            raise

    # -- moving sub-groups ----------------------------------------------------------------------------------
    def _read_group(self, g: int) -> None:
        for state, view in zip(STATES, self._group_views[g], strict=True):
            try:
                self.files.read(g, state, view)
            except OSError as err:
                raise os_error(err, "read", self.files.path(g, state)) from None

    def _write_group(self, g: int) -> list[tuple[Path, Path, int]]:
        written = []
        try:
            for state, view in zip(STATES, self._group_views[g], strict=True):
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
        reads, writes, last_write, error = [], [], [None] * self.slots, None
        try:
            for g, group in enumerate(self.groups):
                # The slots of g .. g+B-1 last held g-B .. g-1, whose writes have all been queued by now.
                while len(reads) < min(g + self.slots, len(self.groups)):
                    ahead = len(reads)
                    reads.append(self._reader.submit(self._read_after, ahead, last_write[ahead % self.slots]))
                reads[g].result()
                host_adam.step(self, grads, clip_factor, units=group)
                if not host_adam.rounds_in_pass:  # module 4's C Adam rounds into the staging buffers itself
                    self._round(group)
                last_write[g % self.slots] = self._writer.submit(_timed, self._write_group, g)
                writes.append(last_write[g % self.slots])
        except Exception as err:
            error = err
        written, io_error = self._drain(reads, writes)
        try:
            self._agree(error or io_error)
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

    # -- where the bytes are ------------------------------------------------------------------------------
    def record(self, ledger) -> None:
        super().record(ledger)  # the slots count as host memory for master, m and v
        for g in range(len(self.groups)):
            for name, state in zip(_LEDGER_NAMES, STATES, strict=True):
                ledger.record_file(name, self.files.path(g, state))

    def host_staging_bytes(self) -> int:
        extra = 0
        if self.dtype == torch.float32 and not self.offload_param:  # the CPU tier uploads from its master
            extra = self.param_staging[0].untyped_storage().nbytes()
        return super().host_staging_bytes() + extra


class NVMeUpdater:
    """The NVMe tier's Adam at the step: the partition read from its files a sub-group at a time."""

    norm_in_adam = False  # the sub-groups are stepped as they arrive; the norm is taken before

    def __init__(self, states: NVMeStates, adam, *, timeline):
        self.states, self.adam, self.timeline = states, adam, timeline

    def update(self, grads: list[torch.Tensor], clip_factor: float, norms=None) -> Update:
        with self.timeline.adam() as clock:
            self.states.step(self.adam, grads, clip_factor)
        return Update(clock.seconds, rounded=True)  # each sub-group was rounded before it left its slot
