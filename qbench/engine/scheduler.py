"""Which requests run in each step.

Continuous batching with a token budget per step, in this order:
1. running decodes, one token each, oldest first; a decode that needs a block when the pool is
   full first evicts from the prefix cache, then preempts the newest running request (its blocks
   are released and it is recomputed later, ahead of every waiting request);
2. the rest of a partial (chunked) prefill;
3. new requests, first come first served, each first matched against the prefix cache. Where requests evict
   (``footprint_of``), a request is admitted only when the pool can still give every running request what it
   may yet take (footprint.py): a pool sized for the eviction budgets then never preempts.
A new request whose prompt shares an uncached block with a prefill in flight waits for that
prefill to land in the cache, so that a shared prefix is computed once.

Static batching is the baseline: a wave of up to ``max_seqs`` requests is admitted only when
nothing runs, with each request's whole budget reserved, and runs until its last member ends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from qbench.engine.block_manager import BlockManager
from qbench.engine.radix import RadixCache
from qbench.engine.sequence import Sequence
from qbench.errors import QBenchError

POLICIES = ("continuous", "static")


@dataclass(frozen=True)
class SchedulerConfig:
    max_seqs: int = 16
    token_budget: int = 4096  # tokens computed per step, decodes and prefill chunks together
    policy: str = "continuous"
    chunk_align: int = 1  # a chunk that does not end its prefill ends on a multiple of this

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise QBenchError(f"scheduler policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.max_seqs < 1 or self.token_budget < self.max_seqs or self.chunk_align < 0:
            raise QBenchError(f"scheduler: token_budget ({self.token_budget}) must be >= max_seqs "
                              f"({self.max_seqs}) >= 1, so that every running decode fits in a step")
        if self.token_budget < self.chunk_align:
            raise QBenchError(f"scheduler: token_budget ({self.token_budget}) is below one block "
                              f"({self.chunk_align})")


@dataclass
class Step:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)

    def describe(self) -> dict:
        """Request ids per phase, for tests and logs."""
        return {"decode": [s.seq_id for s in self.decodes], "prefill": [(s.seq_id, n) for s, n in self.prefills],
                "preempt": [s.seq_id for s in self.preempted]}


def pool_too_small(tokens: int, capacity: int) -> QBenchError:
    return QBenchError(f"a request needs {tokens} KV tokens but the pool holds {capacity}; raise the KV capacity "
                       f"or lower max_new_tokens")


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager, cache: RadixCache | None = None,
                 budget_of=None, evicts=None, footprint_of=None):
        self.cfg = cfg
        self.bm = blocks
        self.cache = cache
        self.budget_of = budget_of or len  # tokens a request may reach; static batching reserves them
        self.evicts = evicts or (lambda seq: False)  # requests that will evict neither read nor fill the prefix cache
        self.footprint_of = footprint_of  # seq -> footprint.Footprint: reserve at admission (eviction)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.free_slots = list(range(cfg.max_seqs))
        self.preemptions = 0
        self.cached_tokens = 0  # prompt tokens found in the prefix cache at admission

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    # -- blocks ----------------------------------------------------------------------------------
    def _make_room(self, need: int) -> bool:
        if need <= self.bm.num_free:
            return True
        if self.cache is not None:
            self.cache.evict(need - self.bm.num_free)
        return need <= self.bm.num_free

    def _claim(self, seq: Sequence) -> int:
        """Blocks ``seq`` may still take: up to its peak (and its forks' shares) until its prefill is done, then up to
        its steady footprint. An evicting request copies shared blocks before compacting, so only its own count."""
        fp = self.footprint_of(seq)
        target = fp.steady if seq.prefilled else fp.admitted(len(seq.forks))
        if fp.evicts:
            held = sum(1 for b in seq.block_table if self.bm.ref_count[b] == 1)
        else:
            held = len(seq.block_table)
        return max(target - held, 0)

    def _preempt(self, seq: Sequence, step: Step) -> None:
        self.running.remove(seq)
        self._drop(seq)
        seq.prefilled = False
        self.waiting.appendleft(seq)
        step.preempted.append(seq)
        self.preemptions += 1

    def _drop(self, seq: Sequence) -> None:
        """Give back a request's blocks, cache pin and residual slot."""
        if seq.cache_node is not None:
            self.cache.unlock(seq.cache_node)
            seq.cache_node = None
        self.bm.release(seq)
        self.free_slots.append(seq.kv_slot)
        self.free_slots.sort()

    # -- the step --------------------------------------------------------------------------------
    def schedule(self) -> Step:
        step = Step()
        if self.cfg.policy == "static":
            return self._schedule_static(step)
        self._fill(step)
        while not step.decodes and not step.prefills and self.running:
            # prefills in flight hold the pool and none can go on: the newest yields to the others
            self._preempt(self.running[-1], step)
            self._fill(step)
        if not step.decodes and not step.prefills and self.waiting:
            raise pool_too_small(self.budget_of(self.waiting[0]), self.bm.num_blocks * self.bm.block_size)
        return step

    def _fill(self, step: Step) -> None:
        budget = self.cfg.token_budget
        for seq in list(self.running):  # 1. decodes
            if not seq.prefilled or seq not in self.running:
                continue
            while not self._make_room(self.bm.blocks_to_write(seq, len(seq))):
                victim = self.running[-1]
                self._preempt(victim, step)
                if victim is seq:
                    break
            if seq in self.running:
                self.bm.prepare_write(seq, len(seq))
                step.decodes.append(seq)
                budget -= 1
        for seq in self.running:  # 2. partial prefills
            if not seq.prefilled and budget > 0:
                n = self._chunk(seq, budget)
                if n:
                    step.prefills.append((seq, n))
                    budget -= n
        if step.preempted:
            return  # the pool is short: admit nothing new until the running requests have room
        while self.waiting and budget > 0 and len(self.free_slots) > len(self.waiting[0].forks):  # 3. new, FCFS
            seq = self.waiting[0]
            if self.cache is not None and seq.cache_node is None and seq.num_cached == 0 and not self.evicts(seq):
                node, blocks = self.cache.match(seq.token_ids[: len(seq) - 1], seq.cache_salt)
                if self._waits_for_inflight(seq, len(blocks)):
                    self.cache.unlock(node)
                    break
                seq.cache_node = node
                for b in blocks:
                    self.bm.incref(b)
                seq.block_table, seq.num_cached = list(blocks), len(blocks) * self.bm.block_size
                seq.cached_tokens = seq.num_cached
                self.cached_tokens += seq.num_cached
            if self.footprint_of is not None and not self._make_room(
                    sum(self._claim(s) for s in self.running) + self._claim(seq)):
                break  # it keeps its prefix-cache match while it waits, as below
            n = self._chunk(seq, budget)
            if not n:
                break
            self.waiting.popleft()
            seq.kv_slot = self.free_slots.pop(0)
            self.running.append(seq)
            step.prefills.append((seq, n))
            budget -= n

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of ``seq``'s prefill to compute now (blocks allocated), or 0 if none fit."""
        left = len(seq) - seq.num_cached
        n = min(left, budget)
        if not self.cfg.chunk_align:  # no chunks: the whole prefill, alone if it is over the budget
            n = left if left <= budget or budget == self.cfg.token_budget else 0
        elif n < left:
            end = (seq.num_cached + n) // self.cfg.chunk_align * self.cfg.chunk_align
            n = end - seq.num_cached
        while n > 0 and not self._make_room(self.bm.blocks_to_write(seq, seq.num_cached + n)):
            # take what the pool holds, still ending on an aligned boundary
            fit = (len(seq.block_table) + self.bm.num_free) * self.bm.block_size
            end = min(seq.num_cached + n - 1, fit) // self.cfg.chunk_align * self.cfg.chunk_align
            n = max(end - seq.num_cached, 0)
        if n:
            self.bm.prepare_write(seq, seq.num_cached + n)
        return n

    def _waits_for_inflight(self, seq: Sequence, cached_blocks: int) -> bool:
        """True when a prefill in flight will cache more whole blocks of ``seq`` than the cache has now."""
        bs = self.bm.block_size
        for other in self.running:
            if other.prefilled or other.cache_salt != seq.cache_salt:
                continue
            a, b = seq.token_ids, other.token_ids
            common = 0
            limit = min(len(a) - 1, len(b))
            while common < limit and a[common] == b[common]:
                common += 1
            if common // bs > cached_blocks:
                return True
        return False

    def _schedule_static(self, step: Step) -> Step:
        if self.running:
            for seq in self.running:
                self.bm.prepare_write(seq, len(seq))  # reserved at admission: never allocates
                step.decodes.append(seq)
            return step
        need = 0
        while self.waiting and len(self.running) < self.cfg.max_seqs:
            seq = self.waiting[0]
            blocks = self.bm.blocks_for(self.budget_of(seq))
            if need + blocks > self.bm.num_free:
                break
            need += blocks
            self.waiting.popleft()
            seq.kv_slot = self.free_slots.pop(0)
            self.bm.reserve(seq, self.budget_of(seq))
            self.running.append(seq)
            step.prefills.append((seq, len(seq)))
        if not self.running and self.waiting:
            raise pool_too_small(self.budget_of(self.waiting[0]), self.bm.num_blocks * self.bm.block_size)
        return step

    # -- after the step --------------------------------------------------------------------------
    def prefill_done(self, seq: Sequence) -> bool:
        """After a chunk ran: True when the request's prefill is complete (then its blocks are cached)."""
        if seq.num_cached < len(seq):
            return False
        seq.prefilled = True
        if not self.evicts(seq):  # an evicting request's blocks are compacted in place: never cached
            self._cache(seq, len(seq))
        return True

    def _cache(self, seq: Sequence, computed: int) -> None:
        """Put the whole blocks of ``seq``'s first ``computed`` tokens in the prefix cache, pinned by ``seq``."""
        if self.cache is None:
            return
        node = self.cache.insert(seq.token_ids[:computed], seq.block_table, seq.cache_salt)
        self.cache.lock(node)
        if seq.cache_node is not None:
            self.cache.unlock(seq.cache_node)
        seq.cache_node = node

    def fork(self, parent: Sequence, child: Sequence, copy_slot) -> None:
        """``child`` joins as a running sequence that shares every block of ``parent``'s prompt."""
        child.kv_slot = self.free_slots.pop(0)
        copy_slot(parent.kv_slot, child.kv_slot)
        self.bm.fork(parent, child)
        child.prefilled = True
        self.running.append(child)

    def finish(self, seq: Sequence) -> None:
        if not seq.evicted:  # compacted blocks no longer hold the tokens their positions say
            self._cache(seq, seq.num_cached)
        self.running.remove(seq)
        self._drop(seq)
