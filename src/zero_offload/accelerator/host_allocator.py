"""The host's memory: malloc tuned to keep freed blocks, and how pinned buffers are made and what they lock.

`keep_freed_blocks`: glibc told to keep freed blocks, as a GPU's caching allocator does (the emulated device).
`pinned_plan`: how a pinned buffer of a given size is made, and how many bytes of RAM it locks; both devices
note each pinned buffer's plan (`remember_plan`) so the memory report counts what a GPU locks.
`host_pages`: a large host buffer on a mapping of its own, in 2 MiB pages, its start staggered (the engine's host
states); `pageable_empty` picks it or malloc by size. `registered_buffer`: such a buffer, page-locked in place
(the CUDA device's large pinned buffers)."""

from __future__ import annotations

import ctypes
import functools
import itertools
import mmap
import weakref
from dataclasses import dataclass

import torch

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


# -- pinned host memory: how much a request really locks ---------------------------------------------------------
PAGE = mmap.PAGESIZE
# Below this, torch's pinned caching allocator: it rounds a block up to the next power of two, so a buffer wastes
# less than its own size (under 16 MiB), and freed blocks are reused. From here on, the pages are locked where
# they lie (cudaHostRegister): a 4.4 GB buffer would otherwise hold 8 GiB of locked memory.
REGISTER_FROM = 16 * 2**20


@dataclass(frozen=True)
class PinPlan:
    """How a pinned host buffer of `requested` bytes is made, and how many bytes of RAM it keeps locked.

    method "caching": torch's pinned caching allocator (`torch.empty(..., pin_memory=True)`), one block rounded
              up to a power of two;
           "register": pageable pages, mapped for this buffer alone and page-locked in place (cudaHostRegister),
              so the locked bytes are the request rounded up to whole pages."""

    method: str
    requested: int
    locked_bytes: int


def pinned_plan(nbytes: int, *, page: int = PAGE) -> PinPlan:
    """How a pinned buffer of `nbytes` is made, and the bytes it locks (pure: no GPU needed)."""
    if nbytes < 0:
        raise ValueError(f"a buffer cannot have {nbytes} bytes")
    if nbytes < REGISTER_FROM:
        rounded = 1 << (nbytes - 1).bit_length() if nbytes > 1 else nbytes
        return PinPlan("caching", nbytes, rounded)
    return PinPlan("register", nbytes, -(-nbytes // page) * page)


# storage data_ptr -> the plan of a live host buffer asked for as pinned (on either device)
_plans: dict[int, PinPlan] = {}


def remember_plan(tensor, plan: PinPlan) -> None:
    """Note `plan` for the storage of `tensor` until that storage dies, for `plan_of` (the memory report)."""
    storage = tensor.untyped_storage()
    _plans[storage.data_ptr()] = plan
    weakref.finalize(storage, _plans.pop, storage.data_ptr(), None)


def plan_of(tensor) -> PinPlan | None:
    """The plan a pinned buffer was made by, or None: pageable, or not made by an accelerator's host_empty."""
    return _plans.get(tensor.untyped_storage().data_ptr())


def locked_host_bytes() -> int:
    """Bytes all live pinned buffers lock, by their plans (the emulated device: what a GPU would lock)."""
    return sum(plan.locked_bytes for plan in list(_plans.values()))


# -- large host buffers: pages of their own, 2 MiB where the OS allows, starts staggered ---------------------------
HUGE_PAGE = 2 * 2**20
# From here on a host buffer gets a mapping of its own (pageable_empty): the host states, gradients and staging
# areas of any model worth offloading. Smaller ones stay with malloc, where a mapping would waste more than it saves.
OWN_PAGES_FROM = 4 * 2**20
# Successive buffers start this much further into their first 2 MiB page, wrapping within STAGGER_SPAN.
STAGGER, STAGGER_SPAN = 4096 + 64, 256 * 2**10
_buffers_mapped = itertools.count(1)


def host_pages(nbytes: int, dtype, *, align: int = 64, mapping=mmap.mmap):
    """(a 1-D tensor of `nbytes` bytes of `dtype`, zeroed, and the `mapping` it lives on): anonymous pages of its
    own, asked for as 2 MiB pages (madvise MADV_HUGEPAGE) where the OS offers them, its start `align`ed.

    Why: the C Adam streams five to seven arrays at once (tuning/cpu_adam.py). On 4 KiB pages, which physical
    page backs each 4 KiB of each array is chance, and so is which cache sets the streams share; malloc may
    also hand out pages of the heap that earlier work left behind. In 2 MiB pages an array's layout in the
    caches is its virtual layout, ours to choose: every buffer starts at a different offset (STAGGER) past a
    2 MiB boundary, because arrays that all began at a boundary would put element i of each in the same cache
    set. On the Zen 4 this made the memory floors faster and the int8 step at one thread faster in make bench
    (course/measured/host-pages-amd-epyc-zen4.txt, bench-host-pages-pairs-amd-epyc-zen4.txt; appendix 4.A.4).

    The first 2 MiB page may hold up to STAGGER_SPAN bytes before the buffer; that is the whole cost in RAM (the
    buffer's last part, past its last 2 MiB boundary, stays in 4 KiB pages). Where free memory is fragmented, the
    kernel may compact it to find 2 MiB pages, or fall back to 4 KiB ones: a cost of the first touch only.
    The mapping lives as long as a tensor made on it (torch.frombuffer keeps it) and is unmapped after."""
    # Private, as malloc's pages are: a forked process gets its own copy, not a window on these.
    pages = mapping(-1, max(nbytes, 1) + HUGE_PAGE + STAGGER_SPAN, flags=mmap.MAP_PRIVATE)
    anchor = ctypes.c_char.from_buffer(pages)
    address = ctypes.addressof(anchor)
    del anchor  # an exported pointer would keep the mapping from being closed
    # Offsets from the mapping's start: its first 2 MiB boundary, and the buffer's start past it.
    boundary = -(-address // HUGE_PAGE) * HUGE_PAGE - address
    start = boundary + (next(_buffers_mapped) * STAGGER) % STAGGER_SPAN // align * align
    # Up to the last 2 MiB boundary inside the buffer: a huge page past its end would be RAM it never uses.
    huge_end = (address + start + nbytes) // HUGE_PAGE * HUGE_PAGE - address
    # MADV_HUGEPAGE is Linux's; elsewhere the buffer simply has pages of its own.
    if hasattr(mmap, "MADV_HUGEPAGE") and huge_end > boundary:
        try:
            pages.madvise(mmap.MADV_HUGEPAGE, boundary, huge_end - boundary)
        except OSError:  # a kernel built without transparent huge pages: 4 KiB pages, as malloc's
            pass
    return torch.frombuffer(pages, dtype=dtype, count=nbytes // dtype.itemsize, offset=start), pages


def pageable_empty(shape, dtype) -> torch.Tensor:
    """An uninitialised pageable host tensor: `host_pages` from OWN_PAGES_FROM bytes on, malloc's below."""
    shape = torch.Size([shape]) if isinstance(shape, int) else torch.Size(shape)
    nbytes = shape.numel() * dtype.itemsize
    if nbytes < OWN_PAGES_FROM:
        return torch.empty(shape, dtype=dtype)
    return host_pages(nbytes, dtype)[0].view(shape)


class LockedPages(mmap.mmap):
    """Anonymous pages of one host buffer, page-locked for DMA by `register(address, nbytes)`.

    The mapping lives as long as the tensor made on it (torch.frombuffer keeps it); `unregister(address)` runs
    in `__del__`, which Python calls before the pages are unmapped."""

    address = 0
    unregister = None

    def __del__(self):
        if self.unregister is not None:
            self.unregister(self.address)
            self.unregister = None


def registered_buffer(nbytes: int, dtype, register, unregister):
    """A 1-D tensor of `nbytes` bytes of `dtype` on pages of its own (`host_pages`, starting on a page so that
    it locks no page more than it needs), locked by `register(address, nbytes)`.

    `register` raises (RuntimeError) where the pages cannot be locked; nothing is left locked then."""
    tensor, pages = host_pages(nbytes, dtype, align=PAGE, mapping=LockedPages)
    address = tensor.data_ptr()
    register(address, nbytes)
    pages.address, pages.unregister = address, unregister
    return tensor
