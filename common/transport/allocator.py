"""Allocator settings for a process that receives large messages: a learner rank.

ZeroMQ's I/O thread mallocs a buffer for each frame it receives, and the rank frees a segment's
frames when it has trained on them, several segments at once. With glibc's default (dynamic)
thresholds, freeing several multi-MB buffers together leaves more free memory at the top of the heap
than it keeps (twice the largest buffer freed so far), so glibc hands it back to the kernel. The
next frame's buffer then faults in fresh zeroed pages: hundreds of page faults per 8 MB segment and
up to ~1 ms more CPU (docs/benchmarks.md). Keeping freed memory mapped lets the next frames reuse
it. The price: up to `trim_threshold_mb` of freed memory stays with the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

log = logging.getLogger("asyncvla.allocator")

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX_MB = 32       # the largest M_MMAP_THRESHOLD glibc documents on 64-bit systems


def keep_freed_buffers(mmap_threshold_mb: int = MMAP_THRESHOLD_MAX_MB, trim_threshold_mb: int = 256) -> bool:
    """Serve buffers below `mmap_threshold_mb` from the heap, and return freed heap memory to the
    kernel only beyond `trim_threshold_mb`. Process-wide, glibc only; returns whether it applied
    (False elsewhere, e.g. musl or macOS, which keep their own policies)."""
    if not 0 < mmap_threshold_mb <= MMAP_THRESHOLD_MAX_MB:
        raise ValueError(f"mmap_threshold_mb={mmap_threshold_mb} is not allowed; glibc takes 1..{MMAP_THRESHOLD_MAX_MB}")
    if trim_threshold_mb < mmap_threshold_mb:
        raise ValueError(f"trim_threshold_mb={trim_threshold_mb} must be at least mmap_threshold_mb={mmap_threshold_mb}")
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # Setting either turns off glibc's dynamic thresholds, so both are set.
    ok = libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold_mb << 20) == 1 and \
        libc.mallopt(M_TRIM_THRESHOLD, trim_threshold_mb << 20) == 1
    if not ok:
        log.warning("glibc refused the allocator settings (mallopt); freed receive buffers go back to the kernel")
    return ok
