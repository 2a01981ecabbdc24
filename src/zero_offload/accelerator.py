"""One interface for device work: a real CUDA GPU, or an emulated device on the CPU.

Every device operation of the engine goes through an `Accelerator`: allocating device buffers, host buffers
(pinned when CUDA exists), streams and events, and memory statistics. The emulated device lets a laptop run the
same code as a GPU server: its "device" tensors live in host memory, but every byte placed on the device is charged
to a budget, and going over it raises an out-of-memory error that reads like CUDA's.

Choosing: CUDA when it is available, unless `ZO_DEVICE=cpu`; `ZO_DEVICE=cuda` insists on CUDA.
Budget: the config's `"zero_offload": {"device_memory": "512MB"}`, else `ZO_DEVICE_MEMORY`, else unlimited.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
import weakref
from dataclasses import dataclass, field

import torch

from .streams import CudaStream, Event, WorkerStream, on_worker_stream
from .units import format_bytes, parse_bytes

# What to change when a category of device memory runs out. The engine names the category it allocates,
# so the error can point at the one setting that helps.
OFFLOAD_HINTS = {
    "parameters": 'shard and offload the parameters: "zero_optimization": {"stage": 3, '
    '"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}',
    "gradients": 'partition the gradients and move them off the device: "zero_optimization": '
    '{"stage": 2, "offload_optimizer": {"device": "cpu"}}',
    "master_weights": 'keep the fp32 master weights and Adam moments on the host: "zero_optimization": '
    '{"stage": 2, "offload_optimizer": {"device": "cpu"}}',
    "optimizer_states": 'keep the fp32 master weights and Adam moments on the host: "zero_optimization": '
    '{"stage": 2, "offload_optimizer": {"device": "cpu"}}',
    "activations": 'lower "train_micro_batch_size_per_gpu" (raise "gradient_accumulation_steps" to keep the '
    'global batch), or recompute activations with "activation_checkpointing"',
}
CATEGORIES = (
    "parameters",
    "gradients",
    "master_weights",
    "optimizer_states",
    "buckets",
    "activations",
    "other",
)


def offload_hint(category: str) -> str:
    """The setting that frees device memory of `category`."""
    return OFFLOAD_HINTS.get(category, "offload model states to the host (see zero_optimization)")


def hinted_oom(err: torch.OutOfMemoryError, category: str) -> torch.OutOfMemoryError:
    """torch's out-of-memory error with the setting that frees memory of `category` added to its text."""
    if "Hint:" in str(err):  # raised by an allocation that already named its category
        return err
    return torch.OutOfMemoryError(f"{err}\nWhile allocating {category}. Hint: {offload_hint(category)}.")


class HintOnOutOfMemory(contextlib.AbstractContextManager):
    """Re-raises an out-of-memory error from inside the block as `hinted_oom(err, category)`."""

    def __init__(self, category: str):
        self.category = category

    def __exit__(self, kind, err, tb):
        if isinstance(err, torch.OutOfMemoryError):
            hinted = hinted_oom(err, self.category)
            if hinted is not err:
                raise hinted.with_traceback(tb) from None  # where it ran out, without torch's text twice
        return False


class _Allocation:
    """One live block of emulated device memory."""

    __slots__ = ("key", "nbytes", "category", "live")

    def __init__(self, key: int, nbytes: int, category: str):
        self.key, self.nbytes, self.category, self.live = key, nbytes, category, True


class DeviceOutOfMemoryError(torch.OutOfMemoryError):
    """The emulated device's budget is exhausted; a subclass of torch's OOM so handlers catch both."""


@dataclass
class MemoryStats:
    """Device bytes in use now and at the peak, against the capacity (None = unlimited).

    `reserved`: what the device's allocator holds, in use or cached for reuse; a CUDA budget caps this, not
    `in_use`. The emulated device caches nothing, so there it equals `in_use`.
    """

    in_use: int
    peak: int
    capacity: int | None
    by_category: dict[str, int] = field(default_factory=dict)
    reserved: int = 0


class Accelerator:
    """Base class: what the engine may ask of a device. Subclasses: `CudaAccelerator`, `EmulatedAccelerator`."""

    name = "abstract"
    device: torch.device

    def empty(self, shape, dtype: torch.dtype, *, category: str = "other") -> torch.Tensor:
        raise NotImplementedError

    def zeros(self, shape, dtype: torch.dtype, *, category: str = "other") -> torch.Tensor:
        return self.empty(shape, dtype, category=category).zero_()

    def host_empty(self, shape, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def is_on_device(self, tensor: torch.Tensor) -> bool:
        raise NotImplementedError

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> None:
        """`dst.copy_(src)` across the link. `non_blocking`: from or into pinned memory the copy may still be
        running when this returns; the host must not rewrite `src` (or read a host `dst`) before an event
        recorded after it (`record_event`) has completed."""
        dst.copy_(src)

    def record_event(self) -> Event:
        """An event that completes once the device work this thread has queued so far (its non-blocking copies
        included) has finished: what the host waits for before it rewrites a buffer such a copy reads."""
        return Event()

    def fence_copies(self) -> None:
        """Order the host thread's later writes to device memory after its non-blocking copies. A GPU's stream
        does this by itself; the emulated device, whose "kernels" are the host thread's own, waits here."""

    def free_storage(self, tensor: torch.Tensor) -> None:
        """Give back the memory of a device tensor but keep the tensor (its shape, its views, autograd's
        references to it) so that `restore_storage` can refill it: how ZeRO-3 releases a gathered layer."""
        raise NotImplementedError

    def restore_storage(self, tensor: torch.Tensor, category: str = "parameters") -> None:
        """Allocate the memory of a tensor freed by `free_storage` again (its contents are undefined)."""
        raise NotImplementedError

    def compute_dtype(self, storage_dtype: torch.dtype) -> torch.dtype:
        return storage_dtype

    def new_stream(self, name: str = "zo-stream", cores: list[int] | None = None):
        """A queue of device work that runs in order; `cores` pins an emulated device's stream thread."""
        raise NotImplementedError

    def memory_stats(self) -> MemoryStats:
        raise NotImplementedError

    def reset_peak(self) -> None:
        raise NotImplementedError

    def activations(self, storage_dtype: torch.dtype = torch.float32):
        """Context manager under which tensors saved for backward are charged to the device."""
        return contextlib.nullcontext()

    def mark_compute_copy(self, tensor: torch.Tensor, source: torch.Tensor | None = None) -> None:
        """Declare `tensor` an artefact of computing in another precision, not real device memory; if it is
        `source` upcast, backward upcasts `source` again rather than keeping `tensor` alive."""


# glibc's mallopt() parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit systems.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20
_TRIM_THRESHOLD = 256 * 2**20


@functools.cache
def keep_freed_blocks() -> bool:
    """Make the host's allocator keep freed blocks for reuse, as a GPU's caching allocator does; True if it could.

    The emulated device allocates its buffers (gradient buckets, activations) with malloc. glibc hands blocks
    above a moving threshold back to the kernel when they are freed, so the next step's buffers come back as
    fresh pages: a page fault and a page of zeros every 4 KiB, about 15 MB a step for the 10M-parameter model,
    on whichever thread happens to allocate. A GPU never pays this (its caching allocator keeps freed blocks),
    and on two cores it made every timing here depend on where glibc's threshold had drifted. Fixing the mmap
    threshold at its maximum and trimming the heap only past 256 MiB of free space keeps blocks up to 32 MiB in
    the process; larger ones still go back to the kernel. Process-wide and once; a no-op off glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt): leave malloc alone
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )


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
        hint = offload_hint(category)
        return (
            f"Emulated device out of memory. Tried to allocate {format_bytes(nbytes)} for {category}. "
            f"Budget {format_bytes(self.capacity)}; {format_bytes(self._in_use)} already in use "
            f"({held or 'nothing'}); peak {format_bytes(self._peak)}. "
            f'Hint: {hint}. Or raise the budget: ZO_DEVICE_MEMORY / "zero_offload": {{"device_memory": ...}}.'
        )

    def _track(self, tensor: torch.Tensor, nbytes: int, category: str) -> None:
        storage = tensor.untyped_storage()
        allocation = _Allocation(storage.data_ptr(), nbytes, category)
        self._by_storage[allocation.key] = allocation
        # Storage objects are unique per allocation, so the charge goes back exactly when the memory does,
        # however many views (p.data, p.grad) still point into it until then.
        weakref.finalize(storage, self._untrack, allocation)

    def _untrack(self, allocation: _Allocation) -> None:
        if allocation.live:  # freed once: by free_storage() or when the storage dies, whichever comes first
            allocation.live = False
            self._by_storage.pop(allocation.key, None)
            self._release(allocation.nbytes, allocation.category)

    # -- the interface ----------------------------------------------------------------------------------------
    def empty(self, shape, dtype: torch.dtype, *, category: str = "other") -> torch.Tensor:
        if category not in self._by_category:
            raise ValueError(f"unknown memory category {category!r}; use one of {', '.join(CATEGORIES)}")
        shape = torch.Size([shape]) if isinstance(shape, int) else torch.Size(shape)
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        self._charge(nbytes, category)
        try:
            tensor = torch.empty(shape, dtype=dtype)
        except BaseException:
            self._release(nbytes, category)
            raise
        self._track(tensor, nbytes, category)
        return tensor

    def is_on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._by_storage

    # -- copies as asynchronous as a GPU's ----------------------------------------------------------------------
    def host_empty(self, shape, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
        # Nothing is page-locked here, but a buffer asked for as pinned is remembered: copies from it are the
        # ones a GPU runs by DMA, after the call that launched them has returned.
        tensor = torch.empty(shape, dtype=dtype)
        if pin:
            storage = tensor.untyped_storage()
            self._pinned.add(storage.data_ptr())
            weakref.finalize(storage, self._pinned.discard, storage.data_ptr())
        return tensor

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> None:
        """A non-blocking upload from a pinned buffer is done twice. At once, because every later reader on the
        device is ordered after the copy (on a GPU, by its stream). And again when the link's copy queue gets to
        it, which is when a GPU's DMA engine may really read the source: if the host has rewritten the source
        in between, that is what lands, as it would on a GPU. Correct code never rewrites it before
        `record_event()` says the copy is done, so there the second copy writes the same bytes.
        On a stream's own thread the copy is already ordered on that stream, and is done once."""
        dst.copy_(src)
        uploading = self.is_on_device(dst) and not self.is_on_device(src)
        if non_blocking and uploading and src.untyped_storage().data_ptr() in self._pinned:
            if not on_worker_stream():
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
        self._charge(nbytes, category)
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
        return _ChargeSavedTensors(self, storage_dtype)


def _copy_again(target: weakref.ref, src: torch.Tensor) -> None:
    dst = target()
    if dst is not None:  # a destination nobody holds any more cannot be read, so nothing to redo
        dst.copy_(src)


class _ChargeSavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Charge what autograd saves for backward, as the device would hold it, until backward frees it.

    A fp32 activation is charged at the storage precision (2 bytes in an fp16 run): a GPU computing in fp16
    would hold it in fp16; the emulated device computes in fp32 only because the CPU is slow at fp16.
    Parameters, gradients and the fp32 compute copies of the weights are not charged again.
    """

    def __init__(self, accel: EmulatedAccelerator, storage_dtype: torch.dtype):
        self.accel = accel
        self.shrink = storage_dtype.itemsize / 4 if storage_dtype != torch.float32 else 1.0
        self.live: dict[int, list] = {}  # storage data_ptr -> [handle count, bytes charged]
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        key = tensor.untyped_storage().data_ptr()
        source = self.accel._compute_copies.get(key)
        if source is not None and source.is_contiguous():
            # Upcast again in backward: keeping every layer's fp32 copy from forward to backward would hold
            # the whole model in fp32 at once, memory a GPU computing in fp16 never needs. Autograd often
            # saves a view of the copy (the transposed weight of a matmul): its layout is kept too.
            return _Upcast(source, tensor)
        if key in self.accel._by_storage or key in self.accel._compute_copies:
            return tensor
        if key not in self.live:
            nbytes = tensor.untyped_storage().nbytes()
            if tensor.dtype == torch.float32:
                nbytes = int(nbytes * self.shrink)
            self.accel._charge(nbytes, "activations")
            self.live[key] = [0, nbytes]
        self.live[key][0] += 1
        # Detached: a handle that held the tensor itself would close a reference cycle through autograd's graph
        # that Python's collector cannot see, and a forward without backward would never give its bytes back.
        return _SavedHandle(self, key, tensor.detach())

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, _Upcast):
            return packed.source.to(packed.dtype).as_strided(packed.size, packed.stride, packed.offset)
        return packed.tensor if isinstance(packed, _SavedHandle) else packed

    def _drop(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[key]
            self.accel._release(entry[1], "activations")


class _Upcast:
    """A saved fp32 compute copy, kept as the low-precision weight it came from."""

    __slots__ = ("source", "dtype", "size", "stride", "offset")

    def __init__(self, source: torch.Tensor, saved: torch.Tensor):
        self.source, self.dtype = source, saved.dtype
        self.size, self.stride, self.offset = saved.size(), saved.stride(), saved.storage_offset()


class _SavedHandle:
    """What autograd keeps for one saved tensor; its death is when the device would free the activation."""

    __slots__ = ("owner", "key", "tensor")

    def __init__(self, owner: _ChargeSavedTensors, key: int, tensor: torch.Tensor):
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self):
        self.owner._drop(self.key)


class CudaAccelerator(Accelerator):
    """A real GPU: device tensors, pinned host buffers, CUDA streams and events, torch.cuda statistics."""

    name = "cuda"

    def __init__(self, capacity: int | None = None, index: int | None = None):
        index = torch.cuda.current_device() if index is None else index
        self.device = torch.device("cuda", index)
        self.capacity = capacity
        # Set every time, to the whole device when no budget is given: the cap is per process, and an engine
        # made after one with a budget would otherwise inherit that budget.
        fraction = 1.0
        if capacity is not None:
            fraction = min(1.0, capacity / torch.cuda.get_device_properties(self.device).total_memory)
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        # torch's peak counts from process start: without this, a report would show an earlier engine's peak.
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty(self, shape, dtype: torch.dtype, *, category: str = "other") -> torch.Tensor:
        try:
            return torch.empty(shape, dtype=dtype, device=self.device)
        except torch.OutOfMemoryError as err:
            raise hinted_oom(err, category) from None

    def host_empty(self, shape, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=pin)

    def is_on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> None:
        # Only pinned memory can be copied by DMA; from pageable memory torch's copy returns once it has read it.
        dst.copy_(src, non_blocking=non_blocking and (src.is_pinned() or dst.is_pinned()))

    def record_event(self) -> Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return Event(cuda_event=event)

    def free_storage(self, tensor: torch.Tensor) -> None:
        tensor.untyped_storage().resize_(0)

    def restore_storage(self, tensor: torch.Tensor, category: str = "parameters") -> None:
        with HintOnOutOfMemory(category):  # stage 3's gathers: the largest allocations of a step
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())

    def activations(self, storage_dtype: torch.dtype = torch.float32):
        return HintOnOutOfMemory("activations")

    def new_stream(self, name: str = "zo-stream", cores: list[int] | None = None) -> CudaStream:
        return CudaStream(self.device)  # the copy engines of the GPU: no host core to pin

    def memory_stats(self) -> MemoryStats:
        return MemoryStats(
            torch.cuda.memory_allocated(self.device),
            torch.cuda.max_memory_allocated(self.device),
            self.capacity,
            reserved=torch.cuda.memory_reserved(self.device),
        )

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


def wants_cuda() -> bool:
    """Whether `get_accelerator()` chooses CUDA: `ZO_DEVICE` says so, or it is unset and torch sees a GPU."""
    choice = os.environ.get("ZO_DEVICE", "").strip().lower()
    if choice not in ("", "cuda", "cpu"):
        raise ValueError(f"ZO_DEVICE={choice!r} is not understood; use ZO_DEVICE=cuda or ZO_DEVICE=cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "ZO_DEVICE=cuda but torch sees no CUDA device; unset ZO_DEVICE to use the emulated one"
        )
    return choice != "cpu" and torch.cuda.is_available()


def get_accelerator(device_memory: int | str | None = None) -> Accelerator:
    """The accelerator for this process: CUDA if present (or `ZO_DEVICE=cuda`), else the emulated device."""
    cuda = wants_cuda()
    if device_memory is None and os.environ.get("ZO_DEVICE_MEMORY"):
        try:
            device_memory = parse_bytes(os.environ["ZO_DEVICE_MEMORY"])
        except ValueError as err:
            raise ValueError(f"ZO_DEVICE_MEMORY: {err}") from None
    capacity = None if device_memory is None else parse_bytes(device_memory)
    if cuda:
        return CudaAccelerator(capacity)
    return EmulatedAccelerator(capacity)
