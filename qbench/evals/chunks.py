"""llama.cpp's chunked scoring, shared by the KL-divergence and perplexity evals.

The text is tokenized once and cut into chunks of ``ctx`` tokens. Each chunk is one prefill; only its
second half is scored (logits at positions ctx/2 .. ctx-2 predict tokens ctx/2+1 .. ctx-1), so every
scored token sees at least ctx/2 tokens of context, as in ``llama-perplexity``. Under KV eviction the first half
is the prompt (evicted to the policy's share of it) and the scored half runs as decode steps over what it kept.

Per scored token a run keeps the observed token, its -log p, and the top-K log-probs with their ids
plus the tail mass, never the full-vocabulary logits (llama.cpp's base files are 37 GB for that).
A candidate scored against a baseline's records also gets its KL divergence, Δp and same-top flag.
"""

from __future__ import annotations

import math

import torch
from tqdm import tqdm

from qbench.errors import QBenchError


def namespace(data: str, ctx: int, top_k: int) -> str:
    """Where chunk records live in a run: tasks scoring the same chunks share them (computed once)."""
    import hashlib
    return "chunks-" + hashlib.sha256(f"{data}|{ctx}|{top_k}".encode()).hexdigest()[:12]


def chunk_windows(ids: list[int], ctx: int, limit: int) -> list[list[int]]:
    n = len(ids) // ctx
    if limit:
        n = min(n, limit)
    if n == 0:
        raise QBenchError(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}")
    return [ids[i * ctx: (i + 1) * ctx] for i in range(n)]


def base_record(lp: torch.Tensor, targets: torch.Tensor, top_k: int) -> dict[str, torch.Tensor]:
    """lp (N, V) log-probs at the scored positions, targets (N,) -> what a baseline keeps."""
    top_lp, top_ids = lp.topk(top_k, dim=-1)  # sorted, so top_ids[:, 0] is the argmax
    # exponentials and sums in float64, rounded once: torch takes float32 exps from MKL, whose code path (and so
    # their last bits) follows the CPU, and sums in an order that follows the vector width
    mass = top_lp.double().exp().sum(-1).float()
    tail = torch.log1p(-mass.clamp(max=1 - 1e-7))
    return {"targets": targets, "nll": -lp.gather(1, targets[:, None])[:, 0], "top_ids": top_ids.int(),
            "top_lp": top_lp, "tail_lp": tail}


def kld_topk(base: dict[str, torch.Tensor], lq: torch.Tensor) -> torch.Tensor:
    """KL(base || candidate) per token from the baseline's top-K plus its tail mass.

    The K kept tokens count exactly; the rest of the vocabulary is merged into one "tail" outcome on
    both sides. Merging outcomes never increases KL (log-sum inequality), so this is a lower bound on
    the full-vocabulary KL; the gap is p_tail * KL(p_tail-conditional || q_tail-conditional).
    """
    p_lp = base["top_lp"]  # (N, K)
    q_lp = lq.gather(1, base["top_ids"].long())
    p_tail = base["tail_lp"]
    q_tail = torch.log1p(-q_lp.double().exp().sum(-1).float().clamp(max=1 - 1e-7))
    head = (p_lp.double().exp() * (p_lp - q_lp).double()).sum(-1)
    return (head + p_tail.double().exp() * (p_tail - q_tail).double()).float().clamp(min=0)


def compare_record(base: dict[str, torch.Tensor], own: dict[str, torch.Tensor], lq: torch.Tensor) -> dict:
    return {"kld": kld_topk(base, lq), "p_base": (-base["nll"]).double().exp().float(),
            "p_q": (-own["nll"]).double().exp().float(), "same_top": (own["top_ids"][:, 0] == base["top_ids"][:, 0]),
            "nll_base": base["nll"]}


def score_chunks(subject, windows: list[list[int]], top_k: int, store, task: str, base_store=None,
                 desc: str = "chunks", exact_chunks: int = 0) -> list[dict[str, torch.Tensor]]:
    """Score every window (resuming from stored parts) -> one record per chunk.

    The first ``exact_chunks`` chunks also keep the full-vocabulary log-probs (fp16), so that a candidate
    can report the exact KL there and, with it, the bias of the top-K estimate."""
    first = len(windows[0]) // 2
    records: list[dict | None] = []
    todo = []
    for i in range(len(windows)):
        rec = store.load_part(task, f"chunk_{i:05d}")
        if rec is not None and (base_store is None or "kld" in rec) and (i >= exact_chunks or "full_lp" in rec):
            records.append(rec)
        else:
            records.append(None)
            todo.append(i)
    bar = tqdm(total=len(windows), initial=len(windows) - len(todo), desc=desc, unit="chunk", leave=False)

    def record(i: int, lp: torch.Tensor) -> dict[str, torch.Tensor]:
        w = torch.tensor(windows[i])
        lq = lp[1: len(w) - first]  # (N, V), N = ctx/2 - 1: positions first .. ctx - 2 (lp begins at first - 1)
        own = base_record(lq, w[first + 1:], top_k)
        if i < exact_chunks:
            own["full_lp"] = lq.half()
        if base_store is not None:
            base = base_store.load_part(task, f"chunk_{i:05d}")
            if base is None:
                raise QBenchError(f"the baseline run has no {task} record for chunk {i}; re-run the baseline "
                                  f"to completion")
            if not torch.equal(base["targets"], own["targets"]):
                raise QBenchError(f"chunk {i}: the candidate's tokens differ from the baseline's; both must "
                                  f"use the same tokenizer and data")
            own.update(compare_record(base, own, lq))
            if "full_lp" in base:
                p = base["full_lp"].float()
                own["kld_full"] = (p.double().exp() * (p - lq).double()).sum(-1).float()
        return own

    step = subject.batch_size * subject.dist.world  # one batch per rank, saved before the next
    for s in range(0, len(todo), step):
        idx = todo[s: s + step]
        for i, own in zip(idx, subject.map_logprobs([windows[i] for i in idx], lambda j, lp: record(idx[j], lp),
                                                      prompt_len=first)):
            store.save_part(task, f"chunk_{i:05d}", own)
            records[i] = own
            bar.update(1)
    bar.close()
    return records


def cat(records: list[dict], key: str) -> torch.Tensor:
    return torch.cat([r[key].reshape(r["targets"].shape[0], -1).squeeze(-1) for r in records])


def ppl_se(nll: torch.Tensor) -> dict:
    n = nll.numel()
    m = nll.double().mean().item()
    se = nll.double().std().item() / math.sqrt(n) if n > 1 else float("nan")
    return {"ppl": math.exp(m), "ppl_se": math.exp(m) * se, "mean_nll": m, "tokens": n}
