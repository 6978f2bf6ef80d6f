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


_QUIET = []  # the log callback handed to llama.cpp, kept alive here


def _quiet_llama_cpp() -> None:
    """llama.cpp logs every load and context to stderr; a bench case keeps its own output."""
    import ctypes

    import llama_cpp as L

    if not _QUIET:
        _QUIET.append(L.llama_log_callback(lambda level, text, user_data: None))
        L.llama_log_set(_QUIET[0], ctypes.c_void_p(0))


def llama_cpp_build() -> str:
    """The llama.cpp build the installed llama-cpp-python carries: its version and the CPU features it was
    compiled for (``llama_print_system_info``)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    info = info.decode() if isinstance(info, bytes) else str(info)
    return f"llama-cpp-python {llama_cpp.__version__}: {' '.join(info.split())}"


def run_llama_cpp(gguf: Path, prompts: list[list[int]], gen_len: int, threads: int) -> dict:
    """Greedy decode of every prompt at once through llama.cpp's batch API, on the GGUF qbench's model came
    from: one ``llama_decode`` per step carries one token of each sequence (its own sequence id and position),
    as a server batches requests. The prompts go in as qbench's token ids, so both engines see the same tokens.
    """
    import ctypes

    import llama_cpp as L
    import numpy as np

    B, P = len(prompts), max(len(p) for p in prompts)
    _quiet_llama_cpp()
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(gguf).encode(), L.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    cp = L.llama_context_default_params()
    cp.n_ctx = B * (P + gen_len + 16)  # each sequence gets its own share of the context
    cp.n_batch = max(512, B * P)
    cp.n_seq_max = B
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(max(B * P, B), 0, 1)

    def submit(rows: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, wants logits)
        for i, (tok, pos, seq, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, int(logits)
        batch.n_tokens = len(rows)
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(i: int) -> int:
        ptr = L.llama_get_logits_ith(ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                                   shape=(n_vocab,))))

    try:
        t0 = time.perf_counter()
        submit([(t, j, b, j == len(p) - 1) for b, p in enumerate(prompts) for j, t in enumerate(p)])
        prefill = time.perf_counter() - t0
        last = np.cumsum([len(p) for p in prompts]) - 1  # each prompt's last row in the prefill batch
        nxt = [argmax(int(i)) for i in last]
        tokens, steps = [[t] for t in nxt], []
        for step in range(gen_len - 1):
            t0 = time.perf_counter()
            submit([(nxt[b], len(prompts[b]) + step, b, True) for b in range(B)])
            steps.append(time.perf_counter() - t0)
            nxt = [argmax(b) for b in range(B)]
            for b in range(B):
                tokens[b].append(nxt[b])
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    return {"prefill_s": prefill, "decode_s": steps, "batch": B, "weight_bytes": gguf.stat().st_size,
            "tokens": tokens, "decode_weight_bytes": gguf_decode_bytes(gguf)}


def gguf_decode_bytes(gguf: Path) -> int:
    """Tensor bytes a llama.cpp decode step reads: all but ``token_embd`` when the GGUF has its own
    ``output`` head (a tied model reads the table whole as its head)."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors}
    total = sum(sizes.values())
    return total - sizes.get("token_embd.weight", 0) if "output.weight" in sizes else total
