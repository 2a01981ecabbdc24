"""What the engine may ask of a device, and the out-of-memory errors that say which setting would help."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..units import format_bytes
from .host_allocator import pageable_empty
from .streams import Event

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
    "buckets": 'lower "zero_optimization": {"reduce_bucket_size": ...} (elements of gradient reduced at once; '
    'with stage 3 also "stage3_prefetch_bucket_size", the weights uploaded and gathered ahead)',
    "gathered_parameters": 'lower "zero_optimization": {"stage3_prefetch_bucket_size": ...} (elements of '
    'weights gathered ahead of the layer that runs), or keep the shards on the host: "offload_param": '
    '{"device": "cpu"}',
    "the optimizer step": "the step's fp32 gradients and Adam's temporaries are device memory until the step "
    'runs on the host: "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}',
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


def restore_hint(category: str) -> str:
    """The hint for a storage restored as `category`: restoring parameters is a stage-3 gather, which its own
    setting (how much is gathered at once) shrinks."""
    return "gathered_parameters" if category == "parameters" else category


def hinted_oom(
    err: torch.OutOfMemoryError,
    category: str,
    *,
    nbytes: int | None = None,
    stats: MemoryStats | None = None,
) -> torch.OutOfMemoryError:
    """`err` again, of its own type, its text followed by what was being allocated and the setting that frees
    memory of `category`; `err` itself if it already carries a hint (an OOM passing through two wrappers keeps
    the first, most precise one). The caller raises it `from err`."""
    if getattr(err, "hinted_category", None) is not None:
        return err
    what = category if nbytes is None else f"{format_bytes(nbytes)} of {category}"
    used = ""
    if stats is not None:
        budget = "no budget" if stats.capacity is None else f"budget {format_bytes(stats.capacity)}"
        used = f" The device holds {format_bytes(stats.in_use)} ({budget})."
    # One paragraph: torch's own text may span lines.
    text = " ".join(str(err).split())
    message = f"{text} While allocating {what}.{used} Hint: {offload_hint(category)}."
    try:
        hinted = type(err)(message)
    except TypeError:  # a subclass whose constructor takes other arguments
        hinted = torch.OutOfMemoryError(message)
    hinted.hinted_category = category
    return hinted


class HintOnOutOfMemory(contextlib.AbstractContextManager):
    """Re-raises an out-of-memory error from inside the block as `hinted_oom(err, category)`, chained to it."""

    def __init__(self, category: str):
        self.category = category

    def __exit__(self, kind, err, tb):
        if isinstance(err, torch.OutOfMemoryError):
            hinted = hinted_oom(err, self.category)
            if hinted is not err:
                raise hinted.with_traceback(tb) from err
        return False


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
        """An uninitialised host tensor, page-locked if `pin` (where the device can lock pages); a large one on
        pages of its own (host_allocator.py's `pageable_empty`)."""
        return pageable_empty(shape, dtype)

    def is_on_device(self, tensor: torch.Tensor) -> bool:
        raise NotImplementedError

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether host `tensor` is page-locked (the emulated device: asked for as pinned), so DMA can read it."""
        return tensor.is_pinned()

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> None:
        """`dst.copy_(src)` across the link. `non_blocking`: from or into pinned memory the copy may still be
        running when this returns; the host must not rewrite `src` (or read a host `dst`) before an event
        recorded after it (`record_event`) has completed."""
        dst.copy_(src)

    def record_event(self) -> Event:
        """An event that completes once the device work this thread has queued so far (its non-blocking copies
        included) has finished: what the host waits for before it rewrites a buffer such a copy reads."""
        return Event()

    def issuing_on(self, stream):
        """Context manager: the block's device work (copies, collectives) queues on `stream` (one of
        `new_stream`'s) instead of the compute stream. The emulated device runs such work on the calling thread,
        in order, so the block needs nothing there."""
        return contextlib.nullcontext()

    def compute_waits(self, event: Event) -> None:
        """Later work on the compute stream starts after `event` (a GPU enqueues the wait; the emulated device,
        whose compute is the calling thread, waits here)."""
        event.wait()

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
