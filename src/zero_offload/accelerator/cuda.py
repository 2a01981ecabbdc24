"""A real GPU behind the `Accelerator` interface."""

from __future__ import annotations

import contextlib
import gc
import os
import weakref

import torch

from .base import Accelerator, HintOnOutOfMemory, MemoryStats, hinted_oom, restore_hint
from .host_allocator import pageable_empty, pinned_plan, registered_buffer, remember_plan
from .streams import CudaStream, Event


def gpu_of_this_rank() -> int:
    """The GPU this process uses: LOCAL_RANK's, where a launcher set it (one GPU per rank on each node, whoever
    made the process group), else the current device. More ranks on a node than GPUs is refused."""
    value = os.environ.get("LOCAL_RANK", "").strip()
    if not value:
        return torch.cuda.current_device()
    if not value.isdigit():
        raise ValueError(f"the environment variable LOCAL_RANK={value!r} is not a whole number")
    local_rank, count = int(value), torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but this node has {count} GPU(s): start at most {count} rank(s) per node "
            "(torchrun --nproc_per_node), or run every rank on the emulated device with ZO_DEVICE=cpu (gloo)"
        )
    torch.cuda.set_device(local_rank)
    return local_rank


# device index -> (the accelerator whose budget caps this process's use of that GPU, its budget)
_cap_owners: dict[int, tuple[weakref.ref, int | None]] = {}


class CudaAccelerator(Accelerator):
    """A real GPU: device tensors, pinned host buffers, CUDA streams and events, torch.cuda statistics."""

    name = "cuda"

    def __init__(self, capacity: int | None = None, index: int | None = None):
        index = gpu_of_this_rank() if index is None else index
        self.device = torch.device("cuda", index)
        self.capacity = capacity
        # torch's cap is per process and device: a second budget would silently change a live engine's. The
        # first accelerator alive owns it; once it is gone, the next one sets the cap afresh (the whole device
        # when it has no budget, so that it does not inherit an old one).
        owner, budget = _cap_owners.get(index, (lambda: None, None))
        if owner() is not None and budget != capacity:
            gc.collect()  # an engine dropped but caught in a reference cycle no longer counts
            if owner() is not None:
                raise ValueError(
                    f"cuda:{index} is already capped at {_budget(budget)} for an engine still alive in this process, and "
                    f"this one asks for {_budget(capacity)}: the cap is per process. Give every engine of the process the "
                    "same zero_offload.device_memory (or ZO_DEVICE_MEMORY), or pass the first engine's accelerator on"
                )
        if owner() is None:
            _cap_owners[index] = (weakref.ref(self), capacity)
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
            nbytes = (shape if isinstance(shape, int) else torch.Size(shape).numel()) * dtype.itemsize
            raise hinted_oom(err, category, nbytes=nbytes, stats=self.memory_stats()) from err

    def host_empty(self, shape, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
        if not pin:
            return pageable_empty(shape, dtype)
        shape = torch.Size([shape]) if isinstance(shape, int) else torch.Size(shape)
        plan = pinned_plan(shape.numel() * dtype.itemsize)
        if plan.method == "caching":
            tensor = torch.empty(shape, dtype=dtype, pin_memory=True)
        else:
            tensor = registered_buffer(plan.requested, dtype, self._register, _unregister).view(shape)
        remember_plan(tensor, plan)
        return tensor

    def _register(self, address: int, nbytes: int) -> None:
        cudart = torch.cuda.cudart()
        code = cudart.cudaHostRegister(address, nbytes, 0)
        if int(code) != 0:
            _take_last_error(self.device)
            raise RuntimeError(
                f"cudaHostRegister of {nbytes / 2**20:.0f} MiB failed: {cudart.cudaGetErrorString(code)}"
            )

    def is_on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> None:
        # Only pinned memory can be copied by DMA; from pageable memory torch's copy returns once it has read it.
        dst.copy_(src, non_blocking=non_blocking and (src.is_pinned() or dst.is_pinned()))

    def record_event(self) -> Event:
        # Blocking: a host that waits for it sleeps instead of spinning on a core the CPU Adam needs.
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(self.device))
        return Event(cuda_event=event)

    def issuing_on(self, stream: CudaStream):
        return torch.cuda.stream(stream.torch_stream)

    def compute_waits(self, event: Event) -> None:
        event.enqueue_wait(torch.cuda.current_stream(self.device))

    def free_storage(self, tensor: torch.Tensor) -> None:
        tensor.untyped_storage().resize_(0)

    def restore_storage(self, tensor: torch.Tensor, category: str = "parameters") -> None:
        nbytes = tensor.numel() * tensor.element_size()
        try:  # stage 3's gathers: the largest allocations of a step
            tensor.untyped_storage().resize_(nbytes)
        except torch.OutOfMemoryError as err:
            raise hinted_oom(err, restore_hint(category), nbytes=nbytes, stats=self.memory_stats()) from err

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


def _budget(capacity: int | None) -> str:
    return "the whole device" if capacity is None else f"{capacity / 2**30:.2f} GiB"


def _take_last_error(device: torch.device) -> None:
    """Clear the error a failed CUDA call left as CUDA's "last error": the next kernel launch's check would
    report it as its own failure. A launch here takes it (torch has no binding of cudaGetLastError)."""
    with contextlib.suppress(RuntimeError):
        torch.ones(1, device=device)


def _unregister(address: int) -> None:
    # At interpreter exit CUDA may already be gone: the pages are given back with the process then.
    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaHostUnregister(address)
