"""A real GPU behind the `Accelerator` interface."""

from __future__ import annotations

import torch

from .base import Accelerator, HintOnOutOfMemory, MemoryStats, hinted_oom
from .streams import CudaStream, Event


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
