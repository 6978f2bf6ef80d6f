"""The C heap under qbench's tensors: a fixed mmap threshold, and free memory handed back after loading.

glibc serves a large allocation from its own mapping and unmaps it on free, but it raises that threshold
(up to 32 MiB) each time such a mapping is freed, after which blocks of that size come from the heap and
stay resident once freed, wherever they fell. Loading a model and prefilling free many such blocks, so the
peak RSS of one run depended on the order of earlier frees: Qwen2.5-Coder-0.5B `w4g128-h8e8` loaded and
ran the same 64 tokens at 705 to 797 MiB peak in three runs, and 696 MiB in each of three with the
threshold fixed at 1 MiB (4 MiB still varied: 716-765). Both calls are no-ops where the C library lacks them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 1 << 20


@lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Blocks of ``nbytes`` or more get their own mapping, returned on free; True where it took effect."""
    fn = getattr(_libc(), "mallopt", None)
    return fn is not None and fn(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)) == 1


def release_free_memory() -> bool:
    """Hand the heap's free memory back to the system (loading leaves freed read buffers behind: 77 MiB
    resident after loading SmolLM2 w4g64-head, 382 -> 305 MiB); True where the C library could."""
    fn = getattr(_libc(), "malloc_trim", None)
    if fn is None:
        return False
    fn(0)
    return True
