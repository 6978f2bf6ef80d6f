"""Sampling parameters and the per-request sampler.

The seeds' rules: temperature 0 and top_p >= 1 short-circuit; softmax runs in float64
(a float32 cumulative sum over a large vocabulary can end below 1.0); tokens tied with the
cutoff token are kept or dropped together, for top-k as for top-p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from qbench.errors import QBenchError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int = 0
    ignore_eos: bool = False

    def __post_init__(self):
        def bad(name, why):
            raise QBenchError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 means off)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1] (1 means off)")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            bad("max_new_tokens", "must be an integer >= 1")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            bad("seed", "must be an integer >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """probs (V,) float64, normalised -> renormalised probs with top-k then top-p applied."""
    if 0 < top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)  # ties with the k-th token stay
        probs = probs / probs.sum()
    if top_p < 1.0:
        sorted_p = torch.sort(probs, descending=True).values
        cum = torch.cumsum(sorted_p, 0)
        idx = int(torch.searchsorted(cum, torch.tensor([top_p], dtype=cum.dtype)).item())
        cutoff = sorted_p[min(idx, sorted_p.numel() - 1)]
        probs = torch.where(probs >= cutoff, probs, 0.0)  # ties with the cutoff token stay
        probs = probs / probs.sum()
    return probs


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """logits (V,) -> one token id, drawn with this request's own generator."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    probs = filter_probs(probs, params.top_k, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """logits (B, V) -> B token ids. Greedy rows share one argmax."""
    greedy = logits.argmax(-1).tolist()
    return [greedy[i] if p.greedy else sample_token(logits[i], p, generators[i]) for i, p in enumerate(params)]
