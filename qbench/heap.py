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
from contextlib import contextmanager
from functools import lru_cache

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 1 << 20
TRIM_THRESHOLD = 128 * 1024  # glibc's default
CALIBRATION_MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts


@lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _mallopt(param: int, value: int) -> bool:
    fn = getattr(_libc(), "mallopt", None)
    return fn is not None and fn(param, ctypes.c_int(value)) == 1


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Blocks of ``nbytes`` or more get their own mapping, returned on free; True where it took effect."""
    return _mallopt(M_MMAP_THRESHOLD, nbytes)


@contextmanager
def calibration_heap():
    """Inside, blocks under 32 MiB come from the heap and freed ones stay there for the next allocation; after,
    the 1 MiB threshold and trimming return and the heap's free memory is handed back.

    The calibration's float64 passes allocate and free the same temporaries for each window and each block.
    Each as its own mapping is faulted in and zeroed by the kernel again each time: SmolLM2's GPTQ took 52
    million page faults and 80-94 of 320 CPU seconds. From the heap they are reused as they are. The passes run a
    window at a time (passes.windows), so what the heap keeps is one window's temporaries (SmolLM2's largest,
    gate_up's output, is 12 MiB), not the whole calibration's: keeping every block in the heap instead, over
    whole-calibration temporaries, raised the peak RSS from 2.4 GB to 3.4-10.6 GB (README)."""
    ok = _mallopt(M_MMAP_THRESHOLD, CALIBRATION_MMAP_THRESHOLD) and _mallopt(M_TRIM_THRESHOLD, 1 << 30)
    try:
        yield ok
    finally:
        if ok:
            _mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
            fix_mmap_threshold()
            release_free_memory()


def release_free_memory() -> bool:
    """Hand the heap's free memory back to the system (loading leaves freed read buffers behind: 77 MiB
    resident after loading SmolLM2 w4g64-head, 382 -> 305 MiB); True where the C library could."""
    fn = getattr(_libc(), "malloc_trim", None)
    if fn is None:
        return False
    fn(0)
    return True
