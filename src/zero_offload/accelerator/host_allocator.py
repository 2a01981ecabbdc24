"""The host's allocator tuned to keep freed blocks, as a GPU's caching allocator does."""

from __future__ import annotations

import ctypes
import functools

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
