"""Large host buffers on pages of their own (accelerator/host_allocator.py): 2 MiB pages asked for where the OS
has them, starts staggered, exactly the bytes asked for, unmapped with their last view, private to a fork, and
the engine's host states among them."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import sys

import pytest
import torch

from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.accelerator.host_allocator import (
    HUGE_PAGE,
    OWN_PAGES_FROM,
    PAGE,
    STAGGER_SPAN,
    host_pages,
    pageable_empty,
)
from zero_offload.implementation.host_buffers import HostOptimizerStates
from zero_offload.implementation.transfers import host_buffer

LINUX = sys.platform.startswith("linux")


def _kernel_marks_huge_pages() -> bool:
    """Whether this kernel has transparent huge pages and shows a mapping's madvise flags (smaps' VmFlags)."""
    if not (
        LINUX and hasattr(mmap, "MADV_HUGEPAGE") and os.path.exists("/sys/kernel/mm/transparent_hugepage")
    ):
        return False
    with open("/proc/self/smaps") as smaps:
        return any(line.startswith("VmFlags:") for line in smaps)


HUGE_PAGES = pytest.mark.skipif(
    not _kernel_marks_huge_pages(), reason="needs Linux with transparent huge pages and smaps' VmFlags"
)


def _mapping_of(address: int) -> tuple[int, int, list[str]] | None:
    """(start, end, VmFlags) of this process's mapping that holds `address`, from /proc/self/smaps (flags [] where
    smaps has none); or None."""
    found = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if not line.strip():
                continue
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
                if found:
                    return found
                start, end = (int(x, 16) for x in head.split("-"))
                found = (start, end, []) if start <= address < end else None
            elif found and line.startswith("VmFlags:"):
                found = (*found[:2], line.split()[1:])
    return found


@HUGE_PAGES
def test_a_large_host_buffer_is_asked_for_in_2mib_pages_and_holds_exactly_its_bytes():
    numel = OWN_PAGES_FROM // 4 + 3
    buffer = host_buffer(EmulatedAccelerator(), numel, torch.float32, pin=False)
    assert buffer.untyped_storage().nbytes() == 4 * numel  # no slack counted by the ledger or saved with it
    assert buffer.data_ptr() % 64 == 0 and not buffer.any()
    start, end, flags = _mapping_of(buffer.data_ptr())
    assert "hg" in flags, "the buffer's pages were not madvised for transparent huge pages"
    assert start % HUGE_PAGE == 0 and start <= buffer.data_ptr() < start + STAGGER_SPAN
    # The part past the last 2 MiB boundary stays in small pages: a huge page there would hold unused RAM.
    assert end == (buffer.data_ptr() + 4 * numel) // HUGE_PAGE * HUGE_PAGE
    buffer[-1] = 7.0  # every byte asked for is writable
    assert buffer[-1] == 7.0


def test_successive_buffers_start_at_different_offsets_in_their_pages():
    buffers = [pageable_empty(OWN_PAGES_FROM, torch.uint8) for _ in range(4)]
    in_huge_page = [b.data_ptr() % HUGE_PAGE for b in buffers]
    in_page = [b.data_ptr() % PAGE for b in buffers]
    assert len(set(in_huge_page)) == 4 and len(set(in_page)) == 4, (in_huge_page, in_page)
    assert all(offset < STAGGER_SPAN for offset in in_huge_page)


def test_small_buffers_stay_with_malloc_and_shapes_are_kept():
    small = pageable_empty((3, 5), torch.float16)
    large = pageable_empty((2, OWN_PAGES_FROM // 4), torch.float16)
    assert small.shape == (3, 5) and large.shape == (2, OWN_PAGES_FROM // 4) and large.is_contiguous()
    # malloc's storage can grow; one made on a mapping cannot (torch.frombuffer): which allocator made which.
    assert small.untyped_storage().resizable() and not large.untyped_storage().resizable()
    if LINUX:
        start, end, _ = _mapping_of(large.data_ptr())
        assert end - start < large.nbytes + HUGE_PAGE  # a mapping of its own, not malloc's heap


@pytest.mark.skipif(not LINUX, reason="reads /proc/self/maps")
def test_the_pages_are_unmapped_when_the_last_view_dies():
    buffer = host_buffer(EmulatedAccelerator(), OWN_PAGES_FROM, torch.uint8, pin=True)
    address = buffer.data_ptr()
    view = buffer[10:20]
    del buffer
    gc.collect()
    assert _mapping_of(address) is not None, "a live view keeps the pages"
    del view
    gc.collect()
    assert _mapping_of(address) is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_process_writes_its_own_copy():
    buffer = pageable_empty(OWN_PAGES_FROM, torch.uint8).zero_()
    pid = os.fork()
    if pid == 0:  # the child: write (memset: torch's thread pool does not survive a fork), leave at once
        ctypes.memset(buffer.data_ptr(), 9, buffer.numel())
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert not buffer.any(), "the child's writes reached the parent: the pages are shared, not private"


def test_a_kernel_without_transparent_huge_pages_still_gets_a_buffer():
    class NoHugePages(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    buffer, pages = host_pages(OWN_PAGES_FROM, torch.float32, mapping=NoHugePages)
    assert isinstance(pages, NoHugePages) and buffer.numel() == OWN_PAGES_FROM // 4
    buffer.fill_(1.5)
    assert buffer.sum() == 1.5 * buffer.numel()


@HUGE_PAGES
@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_the_engines_host_states_are_on_these_pages(moments):
    states = HostOptimizerStates(
        EmulatedAccelerator(), [OWN_PAGES_FROM // 4, 1000], pin=True, moments=moments
    )
    large = [states.master] + ([states.exp_avg, states.exp_avg_sq] if moments == "fp32" else [])
    for buffer in large:
        assert "hg" in _mapping_of(buffer.data_ptr())[2]
    assert len({b.data_ptr() % PAGE for b in large}) == len(large)
    assert not any(b.any() for b in (states.master, states.exp_avg, states.exp_avg_sq))
