"""KL divergence against the baseline, following llama.cpp's ``perplexity --kl-divergence``.

A run without a baseline stores its top-K records (it can then serve as one); a run with a baseline is
scored on exactly the baseline's tokens and reports llama.cpp's statistics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from qbench.evals.chunks import cat, chunk_windows, namespace, ppl_se, score_chunks
from qbench.evals.data import load_text
from qbench.evals.stats import kld_summary


@dataclass(frozen=True)
class Config:
    data: str = "evals/data/wikitext-2-raw/wiki.test.raw"
    ctx: int = 512
    chunks: int = 8  # 0: every chunk of the text
    top_k: int = 256
    exact_chunks: int = 1  # chunks whose full-vocabulary log-probs are kept, to measure the top-K bias

    def validate(self):
        if self.ctx < 4 or self.ctx % 2:
            raise ValueError(f"ctx: {self.ctx} must be an even number >= 4")
        if self.top_k < 1:
            raise ValueError(f"top_k: {self.top_k} must be >= 1")


def run(subject, cfg: Config, ctx) -> dict:
    t0 = time.perf_counter()
    ids = subject.encode(load_text(cfg.data, f"{ctx.suite_path}: tasks.kld.data"))
    windows = chunk_windows(ids, cfg.ctx, cfg.chunks)
    recs = score_chunks(subject, windows, cfg.top_k, ctx.store, namespace(cfg.data, cfg.ctx, cfg.top_k),
                        ctx.base_store, desc="kld", exact_chunks=cfg.exact_chunks)
    dt = time.perf_counter() - t0
    out = {"chunks": len(windows), "ctx": cfg.ctx, "top_k": cfg.top_k, "own": ppl_se(cat(recs, "nll")),
           "throughput": {"seconds": dt, "items_per_s": len(windows) / dt, "tokens_per_s": len(windows) * cfg.ctx / dt},
           "tail_mass_mean": cat(recs, "tail_lp").double().exp().mean().item()}
    if ctx.base_store is None:
        out["note"] = "no baseline: this run stores its top-K records so that candidates can be scored against it"
        out["score"] = None
        return out
    s = kld_summary(cat(recs, "kld").numpy(), cat(recs, "p_base").numpy(), cat(recs, "p_q").numpy(),
                    cat(recs, "same_top").numpy(), cat(recs, "nll_base").numpy(), cat(recs, "nll").numpy())
    out.update(s)
    out["score"] = s["kld"]["mean"]
    exact = [r for r in recs if "kld_full" in r]
    if exact:
        full, approx = cat(exact, "kld_full").double(), cat(exact, "kld").double()
        out["top_k_check"] = {
            "tokens": full.numel(), "full_vocabulary_mean": full.mean().item(), "top_k_mean": approx.mean().item(),
            "relative_bias": (1 - approx.mean() / full.mean()).item() if full.mean() > 0 else 0.0,
            "note": "the top-K KLD merges the tail and so never exceeds the full-vocabulary KLD; the relative bias "
                    "is measured on the exact chunks of this run"}
    return out
