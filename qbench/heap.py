"""The C heap under qbench's tensors: a fixed mmap threshold, free memory handed back after loading, and a
scratch heap inside a forward pass or a calibration, where the same temporaries recur layer after layer.

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

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's mallopt parameters
MMAP_MAX = 65536  # glibc's default
MMAP_THRESHOLD = 1 << 20
TRIM_THRESHOLD = 128 * 1024  # glibc's default
SCRATCH_MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts


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


_depth = 0  # open scratch() contexts: only the outermost sets and restores the heap's settings


@contextmanager
def scratch(mappings: bool = False):
    """Inside, every block comes from the heap (or, with ``mappings``, blocks under 32 MiB do) and freed ones
    stay there for the next allocation; after the outermost exit, the 1 MiB threshold, mappings and trimming
    return and the heap's free memory is handed back.

    A forward pass allocates and frees the same temporaries for each layer (a 1,024-token prefill of
    SmolLM2: about 35 MiB a layer, 30 layers). Each as its own mapping is faulted in and zeroed by the
    kernel again each time: that cost a W8A8 prefill of 1,024 tokens on SmolLM2 half of its time (0.89 s
    against 0.46 s from the heap, 2-core Xeon) and a batch of 16 x 512 tokens 40% (6.5 s against 3.9 s).
    Blocks of 32 MiB and more come from the heap too (Qwen's gate_up output at 1,024 tokens is 40 MB): a
    1,024-token W8A8 prefill of Qwen took 1.15 s with them as mappings and 1.01 s without.
    From the heap they are reused as they are, and handed back once the pass is over: between passes the
    heap keeps nothing, and during one about what a layer's temporaries need, which the pass held live at
    its peak anyway (bench's peak RSS within 2% either way: README, "Memory")."""
    global _depth
    ok = True
    if _depth == 0:
        ok = _mallopt(M_MMAP_THRESHOLD, SCRATCH_MMAP_THRESHOLD) and _mallopt(M_TRIM_THRESHOLD, 1 << 30) \
            and (mappings or _mallopt(M_MMAP_MAX, 0))
    _depth += 1
    try:
        yield ok
    finally:
        _depth -= 1
        if _depth == 0:  # restored even where one call failed (each is a no-op without mallopt)
            _mallopt(M_MMAP_MAX, MMAP_MAX)
            _mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
            fix_mmap_threshold()
            release_free_memory()


@contextmanager
def calibration_heap():
    """``scratch`` around a calibration. Its float64 passes allocate and free the same temporaries for each
    window and each block: SmolLM2's GPTQ took 52 million page faults and 80-94 of 320 CPU seconds as
    mappings. The passes run a window at a time (passes.windows), so what the heap keeps is one window's
    temporaries (SmolLM2's largest, gate_up's output, is 12 MiB), not the whole calibration's: keeping every
    block in the heap instead, over whole-calibration temporaries, raised the peak RSS from 2.4 GB to
    3.4-10.6 GB (README)."""
    with scratch(mappings=True) as ok:  # float64 temporaries of 32 MiB and more stay mappings
        yield ok


def release_free_memory() -> bool:
    """Hand the heap's free memory back to the system (loading leaves freed read buffers behind: 77 MiB
    resident after loading SmolLM2 w4g64-head, 382 -> 305 MiB); True where the C library could."""
    fn = getattr(_libc(), "malloc_trim", None)
    if fn is None:
        return False
    fn(0)
    return True
