"""Host (CPU) memory: large buffers that are freed go back to the system.

glibc serves an allocation above its mmap threshold with its own mapping and unmaps it when freed;
but each such free raises the threshold to that size (up to 32 MiB), so later buffers of that size
come from the heap, where freed memory stays with the process. FSDP2 allocates and frees a block's
all-gathered weights and reduce-scatter buffers at every forward and backward: on CPU processes
that kept 1.3-1.5x the live memory (docs/results/memory.md). Fixing the threshold (mallopt, as the
MALLOC_MMAP_THRESHOLD_ environment variable would at start) keeps such buffers mapped and returned.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
THRESHOLD = 128 * 1024  # glibc's initial value: buffers from 128 KiB up get a mapping of their own


def return_large_buffers() -> bool:
    """Fix glibc's mmap threshold for this process; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        done = bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD))
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator decides
        return False
    if not done:
        log.debug("mallopt(M_MMAP_THRESHOLD) was refused: the host allocator keeps its own threshold")
    return done
