"""The emulated device: tensors in host memory, the books of a GPU with a memory budget, copies on a link queue."""

from __future__ import annotations

import threading
import weakref

import torch

from ..units import format_bytes
from .base import CATEGORIES, Accelerator, DeviceOutOfMemoryError, MemoryStats, hinted_oom, restore_hint
from .host_allocator import keep_freed_blocks, pageable_empty, pinned_plan, remember_plan
from .saved_tensors import ChargeSavedTensors
from .streams import Event, WorkerStream, on_worker_stream


class _Allocation:
    """One live block of emulated device memory."""

    __slots__ = ("key", "nbytes", "category", "live")

    def __init__(self, key: int, nbytes: int, category: str):
        self.key, self.nbytes, self.category, self.live = key, nbytes, category, True

    def end(self) -> bool:
        """Mark the block freed; True the first time only (it may be freed explicitly and then die as well)."""
        was_live, self.live = self.live, False
        return was_live


class EmulatedAccelerator(Accelerator):
    """A device that lives in host memory but keeps the books of a GPU with `capacity` bytes."""

    name = "emulated"

    def __init__(self, capacity: int | None = None):
        self.device = torch.device("cpu")
        self.capacity = capacity
        keep_freed_blocks()
        self._lock = threading.Lock()
        self._by_storage: dict[int, _Allocation] = {}  # storage data_ptr -> its live allocation
        self._by_category = dict.fromkeys(CATEGORIES, 0)
        self._in_use = self._peak = 0
        # storage data_ptr of a compute copy -> the weight it was upcast from
        self._compute_copies: dict[int, torch.Tensor | None] = {}
        self._pinned: set[int] = set()  # storage data_ptr of host buffers asked for as pinned
        self._dma: WorkerStream | None = None  # the link's copy engine, made on first use

    # -- the budget -------------------------------------------------------------------------------------------
    def _charge(self, nbytes: int, category: str) -> None:
        with self._lock:
            if self.capacity is not None and self._in_use + nbytes > self.capacity:
                raise DeviceOutOfMemoryError(self._oom_message(nbytes, category))
            self._in_use += nbytes
            self._by_category[category] += nbytes
            self._peak = max(self._peak, self._in_use)

    def _release(self, nbytes: int, category: str) -> None:
        with self._lock:
            self._in_use -= nbytes
            self._by_category[category] -= nbytes

    def _oom_message(self, nbytes: int, category: str) -> str:
        held = ", ".join(f"{c} {format_bytes(b)}" for c, b in self._by_category.items() if b)
        return (
            f"Emulated device out of memory. Tried to allocate {format_bytes(nbytes)} for {category}. "
            f'Budget {format_bytes(self.capacity)} (ZO_DEVICE_MEMORY or "zero_offload": {{"device_memory": ...}}); '
            f"{format_bytes(self._in_use)} already in use ({held or 'nothing'}); peak {format_bytes(self._peak)}."
        )

    def _charge_with_its_hint(self, nbytes: int, category: str) -> None:
        self._charge_or_hint(nbytes, category, category)

    def _charge_or_hint(self, nbytes: int, category: str, hint: str) -> None:
        try:
            self._charge(nbytes, category)
        except DeviceOutOfMemoryError as err:
            # The budget's text already says how much is in use: the hint adds only the setting.
            raise hinted_oom(err, hint) from err

    def _track(self, tensor: torch.Tensor, nbytes: int, category: str) -> None:
        storage = tensor.untyped_storage()
        allocation = _Allocation(storage.data_ptr(), nbytes, category)
        self._by_storage[allocation.key] = allocation
        # Storage objects are unique per allocation, so the charge goes back exactly when the memory does,
        # however many views (p.data, p.grad) still point into it until then.
        weakref.finalize(storage, self._untrack, allocation)

    def _untrack(self, allocation: _Allocation) -> None:
        if allocation.end():  # freed once: by free_storage() or when the storage dies, whichever comes first
            self._by_storage.pop(allocation.key, None)
            self._release(allocation.nbytes, allocation.category)

    # -- the interface ----------------------------------------------------------------------------------------
    def empty(self, shape, dtype: torch.dtype, *, category: str = "other") -> torch.Tensor:
        if category not in self._by_category:
            raise ValueError(f"unknown memory category {category!r}; use one of {', '.join(CATEGORIES)}")
        shape = torch.Size([shape]) if isinstance(shape, int) else torch.Size(shape)
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        self._charge_with_its_hint(nbytes, category)
        try:
            tensor = torch.empty(shape, dtype=dtype)
        except BaseException:
            self._release(nbytes, category)
            raise
        self._track(tensor, nbytes, category)
        return tensor

    def is_on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._by_storage

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._pinned

    # -- copies as asynchronous as a GPU's ----------------------------------------------------------------------
    def host_empty(self, shape, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
        # Nothing is page-locked here, but a buffer asked for as pinned is remembered: copies from it are the
        # ones a GPU runs by DMA, after the call that launched them has returned. Its plan is noted as a GPU's
        # would be, so the memory report counts the bytes a GPU would lock.
        tensor = pageable_empty(shape, dtype)
        if pin:
            storage = tensor.untyped_storage()
            self._pinned.add(storage.data_ptr())
            weakref.finalize(storage, self._pinned.discard, storage.data_ptr())
            remember_plan(tensor, pinned_plan(storage.nbytes()))
        return tensor

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> None:
        """A non-blocking upload from a pinned buffer is done twice. At once, because every later reader on the
        device is ordered after the copy (on a GPU, by its stream). And again when the link's copy queue gets to
        it, which is when a GPU's DMA engine may really read the source: if the host has rewritten the source
        in between, that is what lands, as it would on a GPU. Correct code never rewrites it before
        `record_event()` says the copy is done, so there the second copy writes the same bytes.
        On a stream's own thread the copy is already ordered on that stream, and is done once."""
        dst.copy_(src)
        # Cheapest questions first: most copies are blocking, or run on a stream's thread (module 5's).
        if not non_blocking or on_worker_stream() or not self.is_pinned(src):
            return
        if self.is_on_device(dst):  # pinned memory is host memory: this is an upload
            self._dma_queue().submit(_copy_again, weakref.ref(dst), src)

    def _dma_queue(self) -> WorkerStream:
        with self._lock:
            if self._dma is None:
                self._dma = WorkerStream("zo-dma")
            return self._dma

    @property
    def dma(self) -> WorkerStream:
        """The queue on which the emulated link runs its non-blocking copies (tests hold it)."""
        return self._dma_queue()

    def record_event(self) -> Event:
        return self._dma.submit(lambda: None) if self._dma is not None else Event()

    def fence_copies(self) -> None:
        if self._dma is not None:
            self._dma.synchronize()

    def free_storage(self, tensor: torch.Tensor) -> None:
        allocation = self._by_storage.get(tensor.untyped_storage().data_ptr())
        if allocation is None:
            raise ValueError(
                "free_storage: this tensor was not allocated on the device (or is already freed)"
            )
        self._untrack(allocation)
        tensor.untyped_storage().resize_(0)

    def restore_storage(self, tensor: torch.Tensor, category: str = "parameters") -> None:
        nbytes = tensor.numel() * tensor.element_size()
        # Charged to `category`, but what shrinks it is how much stage 3 gathers at once.
        self._charge_or_hint(nbytes, category, restore_hint(category))
        tensor.untyped_storage().resize_(nbytes)
        self._track(tensor, nbytes, category)

    def compute_dtype(self, storage_dtype: torch.dtype) -> torch.dtype:
        # Low-precision matmul has no fast path on CPUs without AVX-512 (fp16 14 GFLOP/s vs fp32 83 here), so
        # the emulated device stores fp16/bf16 but computes in fp32.
        return torch.float32

    def new_stream(self, name: str = "zo-stream", cores: list[int] | None = None) -> WorkerStream:
        return WorkerStream(name, cores)

    def memory_stats(self) -> MemoryStats:
        with self._lock:
            return MemoryStats(
                self._in_use, self._peak, self.capacity, dict(self._by_category), reserved=self._in_use
            )

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._in_use

    def mark_compute_copy(self, tensor: torch.Tensor, source: torch.Tensor | None = None) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        self._compute_copies[key] = source
        weakref.finalize(storage, self._compute_copies.pop, key, None)

    def activations(self, storage_dtype: torch.dtype = torch.float32):
        return ChargeSavedTensors(
            storage_dtype,
            on_device=self._by_storage,
            compute_copies=self._compute_copies,
            charge=self._charge_with_its_hint,
            release=self._release,
        )


def _copy_again(target: weakref.ref, src: torch.Tensor) -> None:
    dst = target()
    if dst is not None:  # a destination nobody holds any more cannot be read, so nothing to redo
        dst.copy_(src)
