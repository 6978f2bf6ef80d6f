"""KV eviction under a token budget (the seeds' second way to shrink the cache, beside quantizing it), as pure
tensor functions: which cached tokens each KV head keeps.

- StreamingLLM: the first ``sinks`` tokens (attention sinks) plus the most recent ones.
- H2O: the heavy hitters by attention accumulated over every query so far, plus a recent window.
- SnapKV: at the end of the prompt, the last ``window`` prompt tokens (the observation window) vote with
  their attention, average-pooled over neighbouring positions, for the prompt positions each KV head keeps;
  the window itself is kept. The defaults (window 64, kernel 5, average pooling) are the SnapKV authors'
  code's and kvpress's. Later tokens (decode) are kept; when the cache must shrink again, the prompt tokens
  with the fewest votes go first.

Every keep-set is a sorted (nkv, m) tensor of cache indices, one row per KV head: the heads keep the same
number of tokens, so one context length serves all of them. A group of query heads that shares a KV head
votes as one (its attention summed). Keys carry their rotation from the write, so a kept key keeps its
original position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

POLICIES = ("none", "streaming", "h2o", "snapkv")


@dataclass(frozen=True)
class Eviction:
    """A policy and its budget: ``budget`` tokens per sequence (an int), or a fraction of each prompt (a float
    in (0, 1]). ``sinks``: StreamingLLM's first tokens. ``window``: StreamingLLM keeps budget - sinks recent
    tokens; H2O's recent window (default half the budget); SnapKV's observation window (default 64).
    ``pool``: SnapKV's average-pooling kernel (odd)."""

    policy: str
    budget: int | float
    sinks: int = 4
    window: int | None = None
    pool: int = 5

    def __post_init__(self):
        if self.policy not in POLICIES[1:]:
            raise ValueError(f"kv.evict: {self.policy!r} is not one of {', '.join(POLICIES)}")
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise ValueError(f"kv.budget: {b!r} must be a token count (an integer) or a fraction in (0, 1]")
        if isinstance(b, float) and not 0 < b <= 1:
            raise ValueError(f"kv.budget: {b} as a fraction of the prompt must lie in (0, 1]; give tokens as an "
                             f"integer")
        if isinstance(b, int) and b < 1:
            raise ValueError(f"kv.budget: {b} tokens; give at least 1")
        if not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"kv.sinks: {self.sinks!r} must be an integer >= 0")
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"kv.window: {self.window!r} must be a positive integer")
        if not isinstance(self.pool, int) or self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"kv.pool: {self.pool!r} must be a positive odd integer")

    def tokens(self, prompt_len: int) -> int:
        """This sequence's budget in tokens (a fraction of its prompt, rounded up; at least one token)."""
        if isinstance(self.budget, float):
            return max(1, math.ceil(self.budget * prompt_len - 1e-9))
        return self.budget

    @property
    def scored(self) -> bool:
        """Whether the policy reads attention scores (which the engine then accumulates)."""
        return self.policy in ("h2o", "snapkv")

    def recent(self, budget: int) -> int:
        if self.policy == "streaming":
            return max(budget - self.sinks, 0)
        if self.policy == "h2o":
            return min(self.window if self.window is not None else budget // 2, budget)
        return min(self.window if self.window is not None else 64, budget)

    def describe(self) -> str:
        name = {"streaming": "StreamingLLM", "h2o": "H2O", "snapkv": "SnapKV"}[self.policy]
        b = f"{self.budget:.0%}" if isinstance(self.budget, float) else f"{self.budget} tokens"
        return f"{name} {b}"


def streaming_keep(n: int, budget: int, sinks: int, nkv: int) -> torch.Tensor:
    """The first ``sinks`` and the last ``budget - sinks`` of n cached tokens -> (nkv, min(n, budget))."""
    if n <= budget:
        idx = torch.arange(n)
    else:
        s = min(sinks, budget)
        idx = torch.cat([torch.arange(s), torch.arange(n - (budget - s), n)])
    return idx.expand(nkv, -1).clone()


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(nkv, n) -> the k highest positions per row; ties go to the earlier position (stable, reproducible)."""
    if k <= 0:
        return scores.new_zeros((scores.shape[0], 0), dtype=torch.int64)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[:, :k]


def scored_keep(scores: torch.Tensor, budget: int, recent: int) -> torch.Tensor:
    """H2O's rule: scores (nkv, n) -> the last ``recent`` positions plus the ``budget - recent`` best-scored of
    the others, per head, sorted -> (nkv, min(n, budget))."""
    nkv, n = scores.shape
    if n <= budget:
        return torch.arange(n).expand(nkv, -1).clone()
    recent = min(recent, budget)
    heavy = _top(scores[:, : n - recent], budget - recent)
    tail = torch.arange(n - recent, n).expand(nkv, -1)
    return torch.sort(torch.cat([heavy, tail], dim=1), dim=1).values


def snapkv_votes(probs: torch.Tensor, pool: int) -> torch.Tensor:
    """probs (nkv, q, n): attention of the observation window's queries (a group's query heads side by side in
    q) over the n keys before the window -> votes (nkv, n): summed over the queries, averaged over ``pool``
    neighbouring keys (zeros past either end count, as in SnapKV's code and kvpress)."""
    votes = probs.sum(dim=1)
    return F.avg_pool1d(votes[:, None], pool, stride=1, padding=pool // 2)[:, 0]


def rank_keep(rank: torch.Tensor, keep: int) -> torch.Tensor:
    """rank (nkv, n): a priority per cached token (higher stays) -> the ``keep`` highest per head, sorted."""
    return torch.sort(_top(rank, keep), dim=1).values


def attention_probs(q: torch.Tensor, qpos: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q (n_q, nh, hd) at cache indices qpos (n_q,), k (n, nkv, hd) -> softmax probabilities (nkv, n_q * g, n)
    over the keys each query may see (causal), a group's query heads side by side."""
    n_q, nh, hd = q.shape
    n, nkv, _ = k.shape
    g = nh // nkv
    qg = q.float().view(n_q, nkv, g, hd).permute(1, 0, 2, 3).reshape(nkv, n_q * g, hd)
    logits = torch.bmm(qg, k.float().permute(1, 2, 0)) * scale  # (nkv, n_q * g, n)
    visible = torch.arange(n)[None, :] <= qpos[:, None]  # (n_q, n)
    logits = logits.masked_fill(~visible.repeat_interleave(g, 0)[None], float("-inf"))
    return torch.softmax(logits, dim=-1)
