"""The memory roofline of decode: what a step must read, and how fast this machine reads.

Batch-1 decode reads every weight the step uses and every KV byte it attends, once, and does about two
FLOPs per weight: it is bound by memory bandwidth, not arithmetic. So the ceiling on decode tok/s is
``batch * bandwidth / bytes_per_step``, and the fraction of it a backend reaches says how much of the
machine it uses, whatever the format (a 4-bit model reads fewer bytes, so its ceiling is higher).
"""

from __future__ import annotations

import os
import time

GiB = 2 ** 30


def last_level_cache_bytes() -> int | None:
    for key in ("SC_LEVEL4_CACHE_SIZE", "SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            n = os.sysconf(key)
        except (ValueError, OSError):
            continue
        if n and n > 0:
            return int(n)
    return None


def read_bandwidth(_case: dict | None = None, repeats: int = 5) -> dict:
    """This machine's streaming read bandwidth on torch's threads: the best of ``repeats`` sums over a
    float32 buffer of at least 2 GiB and 8x the last-level cache, so no repeat is served from cache."""
    import torch

    llc = last_level_cache_bytes()
    nbytes = max(2 * GiB, 8 * (llc or 0))
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        nbytes = min(nbytes, max(avail // 4, 256 * 2 ** 20))
    except (ValueError, OSError):
        pass
    buf = torch.ones(nbytes // 4, dtype=torch.float32)  # written once, so every page is resident
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        float(buf.sum())
        best = min(best, time.perf_counter() - t0)
    del buf
    return {"bytes_per_s": nbytes / best, "buffer_bytes": nbytes, "last_level_cache_bytes": llc,
            "threads": torch.get_num_threads(), "method": f"best of {repeats} float32 sums"}


def step_bytes(weight_bytes: int, kv_bytes_per_token: float, batch: int, prompt_len: int, gen_len: int,
               kv_bytes_per_sequence: int = 0) -> int:
    """Bytes one decode step reads, averaged over the run: the weights it uses once, plus the KV cache of
    every sequence, whose context grows from ``prompt_len`` to ``prompt_len + gen_len - 1`` (and a
    quantized cache's full-precision residual window, a fixed size per sequence)."""
    mean_ctx = prompt_len + (gen_len - 1) / 2
    return int(weight_bytes + batch * (mean_ctx * kv_bytes_per_token + kv_bytes_per_sequence))


def attach(row: dict, bandwidth: float, prompt_len: int, gen_len: int) -> None:
    """Add ``roofline`` to a bench row that says what its decode reads (``decode_weight_bytes``)."""
    w = row.get("decode_weight_bytes")
    if w is None:
        return
    kv = row.get("decode_kv_bytes_per_token", 0)
    per_step = step_bytes(w, kv, row["batch"], prompt_len, gen_len, row.get("decode_kv_bytes_per_sequence", 0))
    ceiling = row["batch"] * bandwidth / per_step
    row["roofline"] = {"bytes_per_step": per_step, "weight_bytes_per_step": w, "kv_bytes_per_token": kv,
                       "ceiling_tok_s": ceiling, "fraction": row["decode_tok_s"] / ceiling}
