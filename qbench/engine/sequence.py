"""One request as the engine sees it: tokens, its block table and its own RNG."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from qbench.engine.sampling import SamplingParams, make_generator
from qbench.errors import QBenchError

_ids = itertools.count()


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are already in the cache
    evicted: int = 0  # of those, tokens evicted: the cache holds num_cached - evicted (kv_len)
    kv_slot: int = 0  # its residual slot in a quantized KV cache, held while it runs
    prefilled: bool = False  # every token but the newest has its K/V in the cache
    cache_salt: str = ""  # the tenant's prefix-cache namespace
    cache_node: object = None  # the prefix-cache node this request pins
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    forks: list = field(default_factory=list)  # sequences that share this prompt (parallel sampling)
    t_first: float | None = None  # perf_counter when its first token was sampled
    t_done: float | None = None  # perf_counter when it finished
    finish_reason: str | None = None
    text: str = ""
    trace: list | None = None  # (first position, logits (n, V)) per forward, when the engine traces logits
    generator: torch.Generator = field(init=False)

    def __post_init__(self):
        self.generator = make_generator(self.params.seed)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def kv_len(self) -> int:
        return self.num_cached - self.evicted

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def make_sequences(prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                   window: int) -> list[Sequence]:
    """Validate prompts against the context window; one Sequence per prompt (one params for all, or each its own)."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    for i, p in enumerate(prompts):
        if not p:
            raise QBenchError(f"prompt {i} is empty; give at least one token")
        if len(p) >= window:
            raise QBenchError(f"prompt {i} has {len(p)} tokens but the model's context window is {window}; "
                              f"shorten it")
    return [Sequence(list(p), sp) for p, sp in zip(prompts, params)]
