"""KV eviction in the block cache: scores from the tapped queries, keep-sets (layers/eviction.py), compaction.

A sequence that will outgrow its budget (prompt plus new tokens over it) is evicted twice over:
- at the end of its prefill, down to the budget;
- on decode, once it holds budget + one block of tokens, down to the budget again.
So it never holds more than budget + one block after a step. Its kept tokens are moved to the front of its
own blocks, in cache order, and the blocks past them go back to the free list.

Rules with the prefix cache: a request that will evict neither reads nor fills it. It computes its whole prompt
(its policy must see every prompt query), and it compacts its own blocks in place, so none of them may be
shared with the cache. A block it does share (with parallel samples of the same prompt) is never rewritten: the
request takes a private copy first.

The scores (H2O's accumulated attention, SnapKV's votes) are computed here from each layer's rotated queries,
which the model runner taps, against the keys in the pool: softmax(q k^T) recomputed in torch for the
tapped rows, not read out of the attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qbench.engine.block_manager import BlockManager
from qbench.engine.sequence import Sequence
from qbench.errors import QBenchError
from qbench.layers.eviction import Eviction, attention_probs, rank_keep, scored_keep, snapkv_votes, streaming_keep

KEPT = 1e30  # SnapKV's rank of tokens it never votes on (the window, decode tokens): above any vote


@dataclass
class _Scores:
    values: torch.Tensor  # (L, nkv, n) float64: H2O's accumulated attention or SnapKV's rank, per cached token


class Evictor:
    def __init__(self, policy: Eviction, blocks: BlockManager, pool, num_layers: int, num_kv_heads: int,
                 scale: float, max_positions: int, make_room=None):
        self.policy = policy
        self.blocks = blocks
        self.pool = pool  # a KVPool; replaced when the engine grows it
        self.L, self.nkv, self.scale = num_layers, num_kv_heads, scale
        self.max_positions = max_positions
        self.make_room = make_room  # (blocks) -> bool: frees blocks from the prefix cache
        self.scores: dict[int, _Scores] = {}
        self.evictions = 0  # compactions, for tests and the bench

    # -- which sequences --------------------------------------------------------------------------------
    def budget(self, seq: Sequence) -> int:
        return self.policy.tokens(len(seq.prompt_ids))

    def evicts(self, seq: Sequence) -> bool:
        """Whether ``seq`` can outgrow its budget: only those are ever scored or evicted, so a budget that
        covers a whole request leaves it bit-identical to no eviction."""
        reach = min(len(seq.prompt_ids) + seq.params.max_new_tokens, self.max_positions)
        return self.budget(seq) < reach

    # -- the runner's taps ------------------------------------------------------------------------------
    def first_tapped(self, seq: Sequence) -> int | None:
        """The first position whose queries the policy reads: every one for H2O, the observation window of
        the prompt for SnapKV (none on decode), none for StreamingLLM."""
        if not self.policy.scored or not self.evicts(seq):
            return None
        if self.policy.policy == "h2o":
            return 0
        if seq.prefilled:
            return None
        return max(len(seq.prompt_ids) - self.policy.recent(self.budget(seq)), 0)

    def queries(self, seq: Sequence, cache_pos: torch.Tensor, per_layer: list[torch.Tensor]) -> None:
        """Add the attention of these queries (n_q,) -> (n_q, nh, hd) per layer, written with their keys, to
        the scores of the keys they see."""
        n = int(cache_pos.max()) + 1
        st = self._scores(seq, n)
        nh = per_layer[0].shape[1]
        chunk = max(1, (1 << 24) // (nh * n))  # queries per softmax: (nkv, chunk * g, n) floats
        for layer, q in enumerate(per_layer):
            k = self.keys(seq, layer, n)
            for i in range(0, q.shape[0], chunk):
                p = attention_probs(q[i: i + chunk], cache_pos[i: i + chunk], k, self.scale)  # (nkv, c*g, n)
                st.values[layer, :, :n] += p.sum(dim=1, dtype=torch.float64)

    def keys(self, seq: Sequence, layer: int, n: int) -> torch.Tensor:
        """The first n cached keys of ``seq`` in one layer (dequantized from a quantized pool) -> (n, nkv, hd)."""
        return self.pool.read_keys(layer, seq.block_table[: self.blocks.blocks_for(n)], n, seq.kv_slot)

    def _scores(self, seq: Sequence, n: int) -> _Scores:
        st = self.scores.get(seq.seq_id)
        if st is None or (not seq.prefilled and seq.num_cached == 0):  # a first chunk: a new (or preempted) request
            st = self.scores[seq.seq_id] = _Scores(torch.zeros(self.L, self.nkv, 0, dtype=torch.float64))
        have = st.values.shape[2]
        if have < n:
            fill = self._fill(seq, have, n)
            st.values = torch.cat([st.values, fill], dim=2)
        return st

    def _fill(self, seq: Sequence, lo: int, hi: int) -> torch.Tensor:
        """Scores of cache indices [lo, hi) never scored: 0 for H2O; for SnapKV (after its vote) a rank above
        every vote, growing with the position, so that decode tokens outlast prompt tokens, newest last out."""
        out = torch.zeros(self.L, self.nkv, hi - lo, dtype=torch.float64)
        if self.policy.policy == "snapkv" and seq.prefilled:
            out += KEPT + torch.arange(lo, hi, dtype=torch.float64) + seq.evicted
        return out

    # -- eviction ---------------------------------------------------------------------------------------
    def after_prefill(self, seq: Sequence) -> None:
        if not self.evicts(seq):
            return
        if self.policy.policy == "snapkv":  # the vote, even where the prompt fits: decode may shrink it later
            self._vote(seq)
        if seq.kv_len > self.budget(seq):
            self._evict(seq)

    def after_decode(self, seq: Sequence) -> None:
        if self.evicts(seq) and seq.kv_len >= self.budget(seq) + self.blocks.block_size:
            self._evict(seq)

    def forget(self, seq: Sequence) -> None:
        self.scores.pop(seq.seq_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        st = self.scores.get(parent.seq_id)
        if st is not None:
            self.scores[child.seq_id] = _Scores(st.values.clone())

    def _vote(self, seq: Sequence) -> None:
        """SnapKV at the end of the prompt: the window's attention, pooled, ranks the tokens before it; the
        window itself ranks above every vote, so it is kept."""
        n, budget, p = seq.kv_len, self.budget(seq), self.policy
        st = self._scores(seq, n)
        w = min(p.recent(budget), n)
        rank = torch.empty(self.L, self.nkv, n, dtype=torch.float64)
        for layer in range(self.L):
            rank[layer, :, : n - w] = snapkv_votes(st.values[layer][:, None, : n - w], p.pool)
        rank[:, :, n - w:] = KEPT + torch.arange(n - w, n, dtype=torch.float64) + seq.evicted
        st.values[:, :, :n] = rank

    def keep_set(self, seq: Sequence) -> torch.Tensor:
        """-> (L, nkv, m) sorted cache indices each layer's KV heads keep."""
        n, budget, p = seq.kv_len, self.budget(seq), self.policy
        if p.policy == "streaming":
            return streaming_keep(n, budget, p.sinks, self.nkv).expand(self.L, -1, -1)
        vals = self._scores(seq, n).values[:, :, :n]
        if p.policy == "h2o":
            return torch.stack([scored_keep(vals[l], budget, p.recent(budget)) for l in range(self.L)])
        return torch.stack([rank_keep(vals[l], budget) for l in range(self.L)])  # SnapKV: by the vote's rank

    def _evict(self, seq: Sequence) -> None:
        keep = self.keep_set(seq)  # (L, nkv, m)
        m = keep.shape[2]
        bm = self.blocks
        old = list(seq.block_table)
        need = bm.blocks_for(m)
        shared = [j for j in range(need) if bm.ref_count[old[j]] > 1]
        if len(shared) > bm.num_free and (self.make_room is None or not self.make_room(len(shared))):
            raise QBenchError(f"KV eviction: request {seq.seq_id} shares {len(shared)} blocks (parallel samples) "
                              f"and the pool has {bm.num_free} free for its private copies; raise the KV capacity")
        new = list(old[:need])
        for j in shared:  # a shared block is never rewritten: this sequence takes a fresh one
            new[j] = bm.allocate()
        self.pool.compact(old, keep, new, seq.kv_len, seq.kv_slot)
        for j in shared:
            bm.decref(old[j])
        for b in old[need:]:
            bm.decref(b)
        seq.block_table = new
        seq.evicted += seq.kv_len - m
        st = self.scores.get(seq.seq_id)
        if st is not None:
            st.values = torch.gather(st.values, 2, keep)  # the scores move with their keys
        self.evictions += 1
