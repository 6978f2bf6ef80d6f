"""The generation loop: static waves of sequences, prefill once, then decode one token each.

The KV pool is sized when first needed and reused; within a call nothing is reallocated
and the cache never grows by concatenation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from qbench.engine.block_manager import BlockManager
from qbench.engine.kv_cache import KVPool, QuantKVPool, blocks_in_budget
from qbench.engine.runner import ModelRunner
from qbench.engine.sampling import SamplingParams, sample_batch
from qbench.engine.sequence import Sequence, make_sequences
from qbench.engine.stopping import check_finished
from qbench.errors import QBenchError
from qbench.models.base import CausalLM


@dataclass
class StepStats:
    prefill_s: list[float] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    decode_batch: list[int] = field(default_factory=list)


class Engine:
    def __init__(self, model: CausalLM, block_size: int = 16, max_batch: int = 16,
                 kv_capacity_tokens: int | None = None, detokenize: Callable[[list[int]], str] | None = None,
                 kv_scheme=None, kv_budget_bytes: int | None = None):
        if block_size < 1 or max_batch < 1:
            raise QBenchError(f"engine: block_size ({block_size}) and max_batch ({max_batch}) must be >= 1")
        if kv_scheme is not None and not kv_scheme.quantized:
            kv_scheme = None  # K16V16 is the full-precision cache itself
        if kv_scheme is not None:
            try:
                kv_scheme.check(block_size, model.config.head_dim)
            except ValueError as e:
                raise QBenchError(f"engine: {e}") from None
        self.model = model
        self.config = model.config
        self.block_size = block_size
        self.max_batch = max_batch
        self.detokenize = detokenize
        self.kv_scheme = kv_scheme  # None: a full-precision cache; else a layers.kvquant.KVScheme
        self.eos_ids = set(model.config.eos_token_ids)
        self.pool: KVPool | None = None
        self.blocks: BlockManager | None = None
        self.runner: ModelRunner | None = None
        self.stats = StepStats()
        if kv_budget_bytes is not None:
            if kv_capacity_tokens is not None:
                raise QBenchError("engine: give a KV capacity in tokens or a byte budget, not both")
            cfg = model.config
            blocks = blocks_in_budget(kv_budget_bytes, cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim,
                                      model.dtype, kv_scheme, max_batch)
            if blocks < 1:
                raise QBenchError(f"engine: a KV budget of {kv_budget_bytes} bytes holds no block; raise it")
            kv_capacity_tokens = blocks * block_size
        self.fixed_capacity = kv_capacity_tokens is not None
        if kv_capacity_tokens is not None:
            self._ensure_pool(kv_capacity_tokens)

    def _ensure_pool(self, tokens: int) -> None:
        num_blocks = -(-tokens // self.block_size)
        if self.pool is not None and self.pool.num_blocks >= num_blocks:
            return
        cfg = self.config
        if self.kv_scheme is None:
            self.pool = KVPool(cfg.num_layers, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                               self.model.dtype)
        else:
            self.pool = QuantKVPool(cfg.num_layers, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                                    self.model.dtype, self.kv_scheme, self.max_batch)
        self.blocks = BlockManager(num_blocks, self.block_size)
        self.runner = ModelRunner(self.model, self.pool)

    def _budget(self, seq: Sequence) -> int:
        """Tokens a sequence may occupy: prompt plus new tokens, capped by the context window."""
        return min(len(seq.prompt_ids) + seq.params.max_new_tokens, self.config.max_positions)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        seqs = make_sequences(prompts, params, self.config.max_positions)
        self._size_pool([self._budget(s) for s in seqs])
        pending = list(seqs)
        while pending:
            wave = self._take_wave(pending)
            self._run_wave(wave)
        return seqs

    def score(self, token_lists: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced log-probs: each list in one prefill through the cache (quantized or not),
        -> log_softmax logits (T_i, V) at every position, float32."""
        seqs = make_sequences(token_lists, SamplingParams(max_new_tokens=1), self.config.max_positions)
        self._size_pool([len(s) for s in seqs])
        out = []
        for i in range(0, len(seqs), self.max_batch):
            wave = seqs[i: i + self.max_batch]
            for j, s in enumerate(wave):
                s.kv_slot = j
                self.blocks.reserve(s, len(s))
            logits = self.runner.prefill(wave, all_logits=True)  # (B, T, V)
            for j, s in enumerate(wave):
                out.append(torch.log_softmax(logits[j, : len(s)], dim=-1))
                self.blocks.release(s)
        return out

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _size_pool(self, budgets: list[int]) -> None:
        """Size the pool for the largest wave of this call; it is reallocated only between calls."""
        if not self.fixed_capacity:
            need = sorted((self.blocks_needed(b) * self.block_size for b in budgets), reverse=True)
            self._ensure_pool(sum(need[: self.max_batch]))

    def _take_wave(self, pending: list[Sequence]) -> list[Sequence]:
        wave, blocks = [], 0
        while pending and len(wave) < self.max_batch:
            need = self.blocks.blocks_for(self._budget(pending[0]))
            if blocks + need > self.blocks.num_free:
                break
            blocks += need
            wave.append(pending.pop(0))
        if not wave:
            raise QBenchError(f"a request needs {self._budget(pending[0])} KV tokens but the pool holds "
                              f"{self.pool.capacity_tokens}; raise the KV capacity or lower max_new_tokens")
        return wave

    def _run_wave(self, wave: list[Sequence]) -> None:
        for i, s in enumerate(wave):
            s.kv_slot = i
            self.blocks.reserve(s, len(s))
        t0 = time.perf_counter()
        logits = self.runner.prefill(wave)
        self.stats.prefill_s.append(time.perf_counter() - t0)
        self.stats.prefill_tokens.append(sum(len(s) for s in wave))
        running = self._append(wave, logits)
        while running:
            for s in running:
                self.blocks.reserve(s, len(s))  # allocates only when crossing a block boundary
            t0 = time.perf_counter()
            logits = self.runner.decode(running)
            self.stats.decode_s.append(time.perf_counter() - t0)
            self.stats.decode_batch.append(len(running))
            running = self._append(running, logits)

    def _append(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Sequence]:
        tokens = sample_batch(logits, [s.params for s in seqs], [s.generator for s in seqs])
        still = []
        for s, tok in zip(seqs, tokens):
            s.output_ids.append(tok)
            check_finished(s, tok, self.eos_ids, self.config.max_positions, self.detokenize)
            if s.finished:
                self.blocks.release(s)
            else:
                still.append(s)
        return still
