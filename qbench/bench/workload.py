"""The bench's prompts: fixed English text, one distinct window of it per batch row."""

from __future__ import annotations

TEXT = (
    "The history of computing is a history of trading one scarce resource for another. Early machines "
    "traded time for memory, storing tables of results so that a clerk need not recompute them. Later, "
    "caches traded memory for time, keeping recently used values close to the processor. Language models "
    "repeat the pattern at a larger scale: the key and value cache stores every past token's projections "
    "so that each new token costs one pass through the weights instead of a pass over the whole history. "
    "Quantization trades a little accuracy for bandwidth, and batching trades latency for throughput. "
    "Each trade has a price, and an honest benchmark states it: the same prompts, the same sampling, the "
    "same seeds, and numbers measured side by side in the same run on the same machine. "
)


def bench_prompts(tokenizer, batch: int, prompt_len: int) -> list[list[int]]:
    """``batch`` prompts of exactly ``prompt_len`` tokens, each starting at a different token."""
    ids = tokenizer(TEXT * (1 + (prompt_len + 8 * batch) // 100))["input_ids"]
    if len(ids) < prompt_len + 8 * batch:
        raise ValueError("bench text too short for this prompt length")
    return [ids[8 * b: 8 * b + prompt_len] for b in range(batch)]
