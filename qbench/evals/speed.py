"""The operating point: decode tok/s and memory of the subject on qbench's engine, at a few batch sizes.

Each batch runs one prompt of ``prompt_tokens`` (cut from the data file) ``new_tokens`` steps with EOS
ignored, after a short warm-up; prefill and decode are timed apart by the engine. Memory is counted,
not sampled: the bytes of the weight tensors and of the KV cache the batch occupies at its last token
(plus the full-precision residual window, where the cache is quantized). Wall-clock figures on a shared
machine drift; compare them within one compare report, never as absolutes across machines.
"""

from __future__ import annotations

import resource
import statistics
from dataclasses import dataclass

from qbench.engine.sampling import SamplingParams
from qbench.evals.data import load_text
from qbench.layers.kvscheme import kv_memory


@dataclass(frozen=True)
class Config:
    data: str = "evals/data/wikitext-2-raw/wiki.test.raw"
    prompt_tokens: int = 256
    new_tokens: int = 64
    batch_sizes: tuple = (1, 4)

    def validate(self):
        if self.prompt_tokens < 1 or self.new_tokens < 2:
            raise ValueError(f"new_tokens: {self.new_tokens} must be >= 2 and prompt_tokens >= 1")
        if not self.batch_sizes or any(not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes: {list(self.batch_sizes)} must be integers >= 1")


def run(subject, cfg: Config, ctx) -> dict:
    prompt = subject.encode(load_text(cfg.data, f"{ctx.suite_path}: tasks.speed.data"))[: cfg.prompt_tokens]
    engine, mc = subject.engine, subject.engine.config
    kv = kv_memory(subject.kv_scheme, mc.num_layers, mc.num_kv_heads, mc.head_dim, engine.model.dtype.itemsize)
    params = SamplingParams(temperature=0.0, max_new_tokens=cfg.new_tokens, ignore_eos=True)
    # timed on this process's engine alone (under data parallelism every rank times its own)
    engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True))  # warm-up
    out = {"prompt_tokens": len(prompt), "new_tokens": cfg.new_tokens, "kv_bytes_per_token": kv["bytes_per_token"],
           "weight_bytes": engine.model.weight_bytes(), "batches": {}}
    for b in cfg.batch_sizes:
        engine.reset_stats()  # this batch's steps only
        engine.clear_prefix_cache()  # the prompt is prefilled b times, as the speed figures assume
        engine.generate([list(prompt) for _ in range(b)], params)
        st = engine.stats
        decode_s = sum(st.decode_s)
        tokens = sum(st.decode_batch)
        context = len(prompt) + cfg.new_tokens
        kv_bytes = b * (context * kv["bytes_per_token"] + kv["residual_bytes_per_sequence"])
        out["batches"][str(b)] = {
            "decode_tokens_per_s": tokens / decode_s, "decode_step_ms_median": 1000 * statistics.median(st.decode_s),
            "prefill_tokens_per_s": sum(st.prefill_tokens) / sum(st.prefill_s),
            "kv_bytes": kv_bytes, "memory_bytes": out["weight_bytes"] + kv_bytes}
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    first = out["batches"][str(cfg.batch_sizes[0])]
    out["score"] = first["decode_tokens_per_s"]
    return out
