"""The model under evaluation: an fp model or an artifact on qbench's engine, with its KV-cache scheme.

Every eval talks to it through two calls: ``logprobs`` (teacher-forced scoring, one prefill per window)
and ``generate``. Both go through the engine's cache, so a quantized KV cache is what gets scored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from qbench.dist.comm import Dist
from qbench.engine.api import Generator
from qbench.engine.sampling import SamplingParams


GENERATE_WAVES = 4


@dataclass
class Generated:
    """What a task reads from a generated sequence, small enough to gather across ranks."""

    output_ids: list[int]
    text: str
    finish_reason: str | None


LONG_CONTEXT = 16384  # where the report compares what one sequence's KV cache holds (eviction keeps a share)


class Subject:
    def __init__(self, model: str, batch_size: int, kv_scheme=None, prefix_cache: bool = True, dist: Dist = Dist()):
        self.spec = model
        self.dist = dist  # data parallel: each rank computes its share of every call's items
        self.gen = Generator(model, backend="qbench", max_batch=batch_size, kv_scheme=kv_scheme,
                             prefix_cache=prefix_cache)
        self.engine = self.gen.backend
        self.tokenizer = self.gen.tokenizer
        self.folder: Path = self.gen.folder
        self.batch_size = batch_size
        # items handed to one generate call: several batches, so continuous batching refills a finished
        # sequence's slot instead of idling until the longest of a batch ends; results are saved per call
        self.generate_chunk = GENERATE_WAVES * batch_size * dist.world
        # the engine keeps an unquantized scheme as no scheme; one that evicts is reported as given
        self.kv_scheme = self.engine.kv_setting if self.engine.eviction is not None else self.engine.kv_scheme
        # where the KV scheme came from: the artifact's recipe, or one given for this run (--kv)
        self.kv_source = None if self.kv_scheme is None else ("run" if kv_scheme is not None else "artifact")

    def prefill_counters(self) -> tuple[int, int]:
        """(prompt tokens computed, prompt tokens served by the prefix cache) so far."""
        st = self.engine.stats
        mine = (st.computed_prefill_tokens, st.cached_tokens)
        every = self.dist.gather([(self.dist.rank, mine)], self.dist.world)  # summed over data-parallel ranks
        return sum(a for a, _ in every), sum(b for _, b in every)

    def describe(self) -> dict:
        from qbench.quant.quantize import source_sha256
        from qbench.layers.kvscheme import kv_memory
        m, model = self.gen.manifest, self.engine.model
        weight_bytes, item = model.weight_bytes(), model.dtype.itemsize
        if m is None:  # the fp model: every weight at the engine's dtype
            params, linear_bits = weight_bytes // item, 8 * item
        else:  # the source model's weights, as the manifest counted them (a tied table once)
            size = m["size"]
            params = size.get("parameters") or (
                size["quantized_weights"] + (weight_bytes - size["quantized_weight_bytes"]) // item)
            linear_bits = size["bits_per_weight"]
        c = model.config
        kv = kv_memory(self.kv_scheme, c.num_layers, c.num_kv_heads, c.head_dim, item)
        ev = None if self.kv_scheme is None else self.kv_scheme.eviction
        kept = LONG_CONTEXT if ev is None else min(LONG_CONTEXT, ev.tokens(LONG_CONTEXT))  # of a 16k prompt
        return {"model": self.spec, "folder": str(self.folder), "weights_sha256": source_sha256(self.folder),
                "recipe": None if m is None else m["recipe"]["name"],
                "kv": None if self.kv_scheme is None else self.kv_scheme.to_dict(),
                "weight_bytes": weight_bytes, "params": params, "bits_per_weight": 8 * weight_bytes / params,
                "quantized_linear_bits_per_weight": linear_bits, "kv_bytes_per_token": kv["bytes_per_token"],
                "kv_scheme": kv["scheme"], "kv_source": self.kv_source,
                "kv_bytes_per_sequence_16k": round(kept * kv["bytes_per_token"] + kv["residual_bytes_per_sequence"])}

    @property
    def eviction(self):
        """The KV eviction policy this subject runs under, or None."""
        return self.engine.eviction

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def logprobs(self, windows: list[list[int]]) -> list[torch.Tensor]:
        """log-softmax (T, V) at every position of each window (this process only)."""
        return self.engine.score(windows)

    def map_logprobs(self, windows: list[list[int]], fn, prompt_len: int | None = None) -> list:
        """``fn(i, logprobs)`` for each window i -> its results in order. Under data parallelism each rank
        scores its share and only ``fn``'s (small) results travel, never the (T, V) log-probs. With ``prompt_len``
        the log-probs begin at position prompt_len - 1 (``Engine.score``), and under KV eviction the tokens after
        the prompt are scored as decode steps over the evicted cache."""
        def run(items):
            return [fn(i, lp) for (i, _), lp in zip(items, self.engine.score([w for _, w in items], prompt_len))]
        return self.dist.map(list(enumerate(windows)), run, self.batch_size)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
        if self.dist.world == 1:
            return self.engine.generate(prompts, params)
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)

        def run(items):
            seqs = self.engine.generate([p for p, _ in items], [sp for _, sp in items])
            return [Generated(s.output_ids, s.text, s.finish_reason) for s in seqs]
        return self.dist.map(list(zip(prompts, params)), run, self.batch_size)


def prefix_cache_use(before: tuple[int, int], after: tuple[int, int]) -> dict:
    """What the engine's prefix cache saved a task: prompt tokens computed and served from the cache."""
    computed, cached = after[0] - before[0], after[1] - before[1]
    return {"prefill_tokens_computed": computed, "prefill_tokens_from_cache": cached,
            "prefill_saved_fraction": cached / (computed + cached) if computed + cached else None}
