"""The generation loop: each step runs what the scheduler picked, decodes then prefill chunks.

The KV pool is sized when first needed and reused; within a call nothing is reallocated
and the cache never grows by concatenation. With ``prefix_cache`` the pool's free blocks also
hold a radix-tree prefix cache that lives across calls, until the pool is resized.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from qbench.engine import scoring
from qbench.engine.block_manager import BlockManager
from qbench.engine.evictor import Evictor
from qbench.engine.footprint import Footprint, footprint, pool_blocks
from qbench.engine.kv_cache import KVPool, QuantKVPool, blocks_in_budget
from qbench.engine.radix import RadixCache
from qbench.engine.runner import ModelRunner
from qbench.engine.scheduler import Scheduler, SchedulerConfig, pool_too_small
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
    decode_context: list[int] = field(default_factory=list)  # cached tokens each decode step read, all rows
    decode_blocks: int = 0  # the most blocks the decoding sequences held after a step (eviction gives back)
    cached_tokens: int = 0  # prompt tokens served by the prefix cache instead of computed
    preemptions: int = 0

    @property
    def computed_prefill_tokens(self) -> int:
        return sum(self.prefill_tokens)


class Engine:
    def __init__(self, model: CausalLM, block_size: int = 16, max_batch: int = 16,
                 kv_capacity_tokens: int | None = None, detokenize: Callable[[list[int]], str] | None = None,
                 kv_scheme=None, kv_budget_bytes: int | None = None, prefix_cache: bool = False,
                 policy: str = "continuous", token_budget: int = 4096):
        if block_size < 1 or max_batch < 1:
            raise QBenchError(f"engine: block_size ({block_size}) and max_batch ({max_batch}) must be >= 1")
        # the full-precision pool's dtype: the model's, or fp16 / bf16 where the scheme says so
        self.kv_dtype = model.dtype if kv_scheme is None or kv_scheme.storage_dtype is None else kv_scheme.storage_dtype
        self.kv_setting = kv_scheme  # as given: an unquantized or evicting scheme too, for reports
        self.eviction = None if kv_scheme is None else kv_scheme.eviction
        if self.eviction is not None:
            if model.config.sliding_window is not None:
                raise QBenchError(f"engine: kv.evict: {model.config.model_type} attends through a sliding window, "
                                  f"which eviction would break; run it without kv.evict")
            if getattr(model, "tp", None) is not None:
                raise QBenchError("engine: kv.evict runs on one process; drop --tp")
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
        self.kv_scheme = kv_scheme  # None: a full-precision cache; else a layers.kvscheme.KVScheme
        self.eos_ids = set(model.config.eos_token_ids)
        self.pool: KVPool | None = None
        self.blocks: BlockManager | None = None
        self.runner: ModelRunner | None = None
        self.stats = StepStats()
        self.observer = None  # called as observer(scheduler, step) once each step is scheduled
        # tests: keep the logits of every position each forward computes (prefill chunks, prefix-cache hits,
        # recomputes after preemption, decodes) in Sequence.trace, to hold them against one whole forward
        self.trace_logits = False
        self.cache: RadixCache | None = None
        self.evictor: Evictor | None = None
        # A quantized cache with a residual window of one block quantizes each block once it is full,
        # from its own tokens only, so full blocks are immutable and prefill chunks that end on block
        # boundaries compute what one whole prefill computes. With a longer window, which blocks a
        # prefill reads quantized depends on where the prefill ends: no chunks and no prefix cache.
        exact_blocks = kv_scheme is None or kv_scheme.windows == 1
        self.prefix_cache = prefix_cache and exact_blocks
        self.prefix_cache_note = None if self.prefix_cache or not prefix_cache else (
            f"prefix cache off: the KV scheme's residual window ({kv_scheme.residual} tokens) is longer than "
            f"one block")
        align = 1 if kv_scheme is None else block_size if exact_blocks else 0
        self.sched_cfg = SchedulerConfig(max_seqs=max_batch, token_budget=max(token_budget, max_batch),
                                         policy=policy, chunk_align=align)
        if kv_budget_bytes is not None:
            if kv_capacity_tokens is not None:
                raise QBenchError("engine: give a KV capacity in tokens or a byte budget, not both")
            cfg = model.config
            blocks = blocks_in_budget(kv_budget_bytes, cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim,
                                      self.kv_dtype, kv_scheme, max_batch)
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
        old = self.pool
        if self.cache is not None:  # grow geometrically, with room for what the prefix cache holds
            num_blocks = max(num_blocks + self.cache.cached_blocks, 2 * old.num_blocks)
        if self.kv_scheme is None:
            self.pool = KVPool(cfg.num_layers, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                               self.kv_dtype)
        else:
            self.pool = QuantKVPool(cfg.num_layers, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                                    self.model.dtype, self.kv_scheme, self.max_batch)
        if self.cache is not None:
            self.pool.adopt(old)
            self.blocks.grow(num_blocks, self.pool.copy_block)
        else:
            self.blocks = BlockManager(num_blocks, self.block_size, self.pool.copy_block)
            self.cache = RadixCache(self.blocks) if self.prefix_cache else None
        self.runner = ModelRunner(self.model, self.pool)
        if self.eviction is not None:
            if self.evictor is None:
                cfg = self.config
                self.evictor = Evictor(self.eviction, self.blocks, self.pool, cfg.num_layers, cfg.num_kv_heads,
                                       cfg.head_dim ** -0.5, cfg.max_positions, self._make_room)
            self.evictor.pool, self.evictor.blocks = self.pool, self.blocks
            self.runner.taps = self.evictor if self.eviction.scored else None

    def _make_room(self, blocks: int) -> bool:
        """Free ``blocks`` blocks from the prefix cache where the free list is short."""
        if self.cache is not None and blocks > self.blocks.num_free:
            self.cache.evict(blocks - self.blocks.num_free)
        return blocks <= self.blocks.num_free

    def reset_stats(self) -> None:
        self.stats = StepStats()

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (timings that must not depend on earlier calls)."""
        if self.cache is not None:
            self.cache.clear()

    def _budget(self, seq: Sequence) -> int:
        """Tokens a sequence may occupy: prompt plus new tokens, capped by the context window."""
        return min(len(seq.prompt_ids) + seq.params.max_new_tokens, self.config.max_positions)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 cache_salt: str = "") -> list[Sequence]:
        seqs = make_sequences(prompts, params, self.config.max_positions)
        self._size_pool([self._footprint(s) for s in seqs])
        for s in seqs:
            s.cache_salt = cache_salt
        self._run(seqs)
        return seqs

    def generate_n(self, prompt: list[int], params: SamplingParams, n: int, cache_salt: str = "") -> list[Sequence]:
        """``n`` samples of one prompt: the prompt is prefilled once and its blocks are shared by all
        ``n`` sequences (a shared partial block is copied by its first writer). Sample i uses seed + i."""
        if n < 1:
            raise QBenchError(f"n={n}: ask for at least one sample")
        if self.sched_cfg.policy != "continuous" or n > self.max_batch:
            raise QBenchError(f"n={n} samples share one prompt under continuous batching with max_batch >= n "
                              f"(policy {self.sched_cfg.policy}, max_batch {self.max_batch})")
        parent = make_sequences([prompt], params, self.config.max_positions)[0]
        parent.cache_salt = cache_salt
        children = [Sequence(list(prompt), replace(params, seed=params.seed + i)) for i in range(1, n)]
        parent.forks = list(children)  # emptied once they have forked
        self._size_pool([self._footprint(parent)] * n)
        self._run([parent])
        return [parent] + children

    def _run(self, seqs: list[Sequence]) -> None:
        ev = self.evictor
        reserve = ev is not None and self.sched_cfg.policy == "continuous"
        sched = Scheduler(self.sched_cfg, self.blocks, self.cache, budget_of=self._budget,
                          evicts=None if ev is None else ev.evicts, footprint_of=self._footprint if reserve else None)
        for s in seqs:
            fp = self._footprint(s)
            if fp.evicts:
                need = fp.admitted(len(s.forks))
            else:
                shared = len(s) // self.block_size  # whole prompt blocks, held once however many samples
                need = shared + (fp.steady - shared) * (1 + len(s.forks))
            if need > self.blocks.num_blocks:
                raise pool_too_small(need * self.block_size, self.pool.capacity_tokens)
            sched.add(s)
        while not sched.done:
            step = sched.schedule()
            if self.observer is not None:
                self.observer(sched, step)
            if step.decodes:
                t0 = time.perf_counter()
                logits = self.runner.decode(step.decodes)
                self.stats.decode_s.append(time.perf_counter() - t0)
                if self.trace_logits:
                    for i, s in enumerate(step.decodes):
                        _trace(s, len(s) - 1, logits[i: i + 1])
                self.stats.decode_batch.append(len(step.decodes))
                self.stats.decode_context.append(sum(s.kv_len for s in step.decodes))
                self._append(sched, step.decodes, logits)
                if ev is not None:
                    for s in step.decodes:
                        ev.after_decode(s) if not s.finished else ev.forget(s)
                held = sum(len(s.block_table) for s in step.decodes)
                self.stats.decode_blocks = max(self.stats.decode_blocks, held)
            if step.prefills:
                seqs_p = [s for s, _ in step.prefills]
                t0 = time.perf_counter()
                starts = [s.num_cached for s in seqs_p]
                lengths = [n for _, n in step.prefills]
                logits = self.runner.prefill(seqs_p, lengths=lengths, all_logits=self.trace_logits)
                self.stats.prefill_s.append(time.perf_counter() - t0)
                if self.trace_logits:  # (B, T, V) -> each chunk's rows, then its last row as usual
                    for i, (s, n) in enumerate(zip(seqs_p, lengths)):
                        _trace(s, starts[i], logits[i, :n])
                    logits = logits[torch.arange(len(seqs_p)), torch.tensor(lengths) - 1]
                self.stats.prefill_tokens.append(sum(lengths))
                ready, rows = [], []
                for i, s in enumerate(seqs_p):
                    if sched.prefill_done(s):
                        if ev is not None:
                            ev.after_prefill(s)  # before the forks share its blocks
                        for child in s.forks:
                            sched.fork(s, child, self.pool.copy_slot)
                            if ev is not None:
                                ev.fork(s, child)
                        ready += [s] + s.forks
                        rows += [i] * (1 + len(s.forks))
                        s.forks = []
                if ready:
                    self._append(sched, ready, logits[rows])
                    for s in ready if ev is not None else ():
                        if s.finished:
                            ev.forget(s)
        self.stats.preemptions += sched.preemptions
        self.stats.cached_tokens += sched.cached_tokens

    def score(self, token_lists: list[list[int]], prompt_len: int | None = None) -> list[torch.Tensor]:
        """Teacher-forced log-probs (T_i, V) at every position, float32, through the cache (engine/scoring.py:
        under eviction, the tokens after ``prompt_len`` run as decode steps over the evicted cache)."""
        return scoring.score(self, token_lists, prompt_len)

    def _footprint(self, seq: Sequence) -> Footprint:
        """The blocks ``seq`` holds at most. Under continuous batching an evicting request's fall to its budget after
        its prefill, and the scheduler reserves that; static batching reserves whole reaches."""
        policy = self.eviction if self.sched_cfg.policy == "continuous" else None
        return footprint(len(seq.prompt_ids), self._budget(seq), self.block_size, policy)

    def size_pool_for(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Make now the pool these requests will need (bench: so that no timed call grows it)."""
        self._size_pool([self._footprint(s) for s in make_sequences(prompts, params, self.config.max_positions)])

    def _size_pool(self, footprints: list[Footprint]) -> None:
        """Size the pool for the largest wave of this call; it is reallocated only between calls."""
        if not self.fixed_capacity:
            self._ensure_pool(pool_blocks(footprints, self.max_batch) * self.block_size)

    def _append(self, sched: Scheduler, seqs: list[Sequence], logits: torch.Tensor) -> None:
        tokens = sample_batch(logits, [s.params for s in seqs], [s.generator for s in seqs])
        now = time.perf_counter()
        for s, tok in zip(seqs, tokens):
            s.output_ids.append(tok)
            if s.t_first is None:
                s.t_first = now
            check_finished(s, tok, self.eos_ids, self.config.max_positions, self.detokenize)
            if s.finished:
                s.t_done = now
                sched.finish(s)


def _trace(seq: Sequence, start: int, logits: torch.Tensor) -> None:
    if seq.trace is None:
        seq.trace = []
    seq.trace.append((start, logits.detach().clone()))
