"""The memory roofline of decode: what a step must read, and how fast this machine reads.

Batch-1 decode reads every weight the step uses and every KV byte it attends, once, and does about two
FLOPs per weight: it is bound by memory bandwidth, not arithmetic. So the ceiling on decode tok/s is
``batch * bandwidth / bytes_per_step``, and the fraction of it a backend reaches says how much of the
machine it uses, whatever the format (a 4-bit model reads fewer bytes, so its ceiling is higher).
"""

from __future__ import annotations

import time
from pathlib import Path

GiB = 2 ** 30


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache, from sysfs (Python's sysconf does not know the cache names on Linux)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
        try:
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (ValueError, IndexError):
            continue
    return max(sizes) if sizes else None


def available_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def read_bandwidth(_case: dict | None = None, repeats: int = 5) -> dict:
    """This machine's streaming read bandwidth on torch's threads: the best of ``repeats`` sums over a
    float32 buffer of at least 2 GiB and 8x the last-level cache, so no repeat is served from cache (at
    most a quarter of the available memory; ``capped`` says when that limit cut it)."""
    import torch

    llc = last_level_cache_bytes()
    want = max(2 * GiB, 8 * (llc or 0))
    avail = available_memory_bytes()
    nbytes = want if avail is None else min(want, max(avail // 4, 256 * 2 ** 20))
    buf = torch.ones(nbytes // 4, dtype=torch.float32)  # written once, so every page is resident
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        float(buf.sum())
        best = min(best, time.perf_counter() - t0)
    del buf
    return {"bytes_per_s": nbytes / best, "buffer_bytes": nbytes, "last_level_cache_bytes": llc,
            "capped": nbytes < want, "threads": torch.get_num_threads(), "method": f"best of {repeats} float32 sums"}


def describe_bandwidth(bw: dict) -> str:
    """'23.2 GB/s (best of 5 float32 sums over 3.8 GiB)': what the log and the table say of a measurement."""
    return f"{bw['bytes_per_s'] / 1e9:.1f} GB/s ({bw['method']} over {bw['buffer_bytes'] / 2**30:.1f} GiB)"


def step_bytes(weight_bytes: int, kv_bytes_per_token: float, batch: int, prompt_len: int, gen_len: int,
               kv_bytes_per_sequence: int = 0, mean_ctx: float | None = None) -> int:
    """Bytes one decode step reads, averaged over the run: the weights it uses once, plus the KV cache of
    every sequence, whose context grows from ``prompt_len`` to ``prompt_len + gen_len - 1`` (and a
    quantized cache's full-precision residual window, a fixed size per sequence). ``mean_ctx``: the tokens a
    step read per sequence, measured, where eviction keeps fewer than the context."""
    if mean_ctx is None:
        mean_ctx = prompt_len + (gen_len - 1) / 2
    return int(weight_bytes + batch * (mean_ctx * kv_bytes_per_token + kv_bytes_per_sequence))


def attach(row: dict, bandwidth: float, prompt_len: int, gen_len: int) -> None:
    """Add ``roofline`` to a bench row that says what its decode reads (``decode_weight_bytes``)."""
    w = row.get("decode_weight_bytes")
    if w is None:
        return
    kv = row.get("decode_kv_bytes_per_token", 0)
    per_step = step_bytes(w, kv, row["batch"], prompt_len, gen_len, row.get("decode_kv_bytes_per_sequence", 0),
                          row.get("decode_context"))
    ceiling = row["batch"] * bandwidth / per_step
    row["roofline"] = {"bytes_per_step": per_step, "weight_bytes_per_step": w, "kv_bytes_per_token": kv,
                       "ceiling_tok_s": ceiling, "fraction": row["decode_tok_s"] / ceiling}
