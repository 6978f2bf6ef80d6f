"""Peers measured beside qbench: transformers' ``generate`` and llama.cpp."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def hf_cache_bytes(cache) -> int:
    """Bytes held by a transformers cache's key/value tensors (4.x and 5.x layouts)."""
    tensors = []
    for layer in getattr(cache, "layers", []) or []:
        tensors += [getattr(layer, "keys", None), getattr(layer, "values", None)]
    tensors += list(getattr(cache, "key_cache", []) or []) + list(getattr(cache, "value_cache", []) or [])
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


def hf_decode_bytes(model) -> int:
    """Tensor bytes a transformers decode step reads: all but an input embedding not tied to the head."""
    from qbench.models.base import unique_storage_bytes

    ptr = model.get_input_embeddings().weight.untyped_storage().data_ptr()
    head = model.get_output_embeddings()
    tensors = list(model.state_dict().values())
    if head is not None and head.weight.untyped_storage().data_ptr() == ptr:
        return unique_storage_bytes(tensors)
    return unique_storage_bytes([t for t in tensors if t.untyped_storage().data_ptr() != ptr])


def run_hf_generate(model, prompts: list[list[int]], gen_len: int, pad_id: int) -> dict:
    """Time ``model.generate`` (greedy, exactly gen_len tokens) with a per-step timestamp hook."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    T = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=gen_len, min_new_tokens=gen_len,
                             do_sample=False, pad_token_id=pad_id, logits_processor=LogitsProcessorList([Stamp()]),
                             return_dict_in_generate=True)
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"prefill_s": stamps[0] - t0, "decode_s": steps, "batch": len(prompts),
            "kv_bytes": hf_cache_bytes(getattr(out, "past_key_values", None)),
            "tokens": out.sequences[:, T:].tolist()}


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
        return True
    except ImportError:
        return False


def run_llama_cpp(gguf: Path, prompt: list[int], gen_len: int, threads: int) -> dict:
    """Batch-1 greedy decode through llama-cpp-python on the GGUF qbench's model came from.

    The prompt goes in as qbench's token ids, so both engines see the same tokens.
    """
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=len(prompt) + gen_len + 16, n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False)
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - t0
    steps, tokens = [], []
    n_vocab = llm.n_vocab()
    for _ in range(gen_len - 1):
        # the last token's logits (llama-cpp-python keeps no score rows unless logits_all)
        tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))
        tokens.append(tok)
        t0 = time.perf_counter()
        llm.eval([tok])
        steps.append(time.perf_counter() - t0)
    size = gguf.stat().st_size
    llm.close()
    return {"prefill_s": prefill, "decode_s": steps, "batch": 1, "weight_bytes": size, "tokens": tokens,
            "decode_weight_bytes": gguf_decode_bytes(gguf)}


def gguf_decode_bytes(gguf: Path) -> int:
    """Tensor bytes a llama.cpp decode step reads: all but ``token_embd`` when the GGUF has its own
    ``output`` head (a tied model reads the table whole as its head)."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors}
    total = sum(sizes.values())
    return total - sizes.get("token_embd.weight", 0) if "output.weight" in sizes else total
