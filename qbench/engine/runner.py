"""Turns a list of sequences into one forward pass: ids, positions, slots and block tables."""

from __future__ import annotations

import torch

from qbench.engine.kv_cache import KVPool
from qbench.engine.sequence import Sequence
from qbench.layers.attention import AttnMetadata, QueryTap
from qbench.layers import linear
from qbench.models.base import CausalLM


PAD_WASTE = 0.25  # the largest share of a pass's rows that may be padding


def pad_groups(lengths: list[int]) -> list[list[int]]:
    """Row indices grouped into passes, longest chunks first, so that padding is at most ``PAD_WASTE`` of
    each pass's rows (a row alone is always its own pass). A chunk shorter than ``DENSE_ROWS`` never joins
    a pass padded to ``DENSE_ROWS`` or more: the linears choose their kernel by a pass's padded length, and
    a token's result must not depend on the chunks it shares a pass with."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g is None or (lengths[i] >= linear.DENSE_ROWS) != (lengths[g[0]] >= linear.DENSE_ROWS):
            groups.append([i])
        elif sum(lengths[j] for j in g) + lengths[i] >= (1 - PAD_WASTE) * (len(g) + 1) * lengths[g[0]]:
            g.append(i)
        else:
            groups.append([i])
    return [sorted(g) for g in groups]


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool):
        self.model = model
        self.pool = pool
        self.block_size = pool.block_size
        self._fused = None  # the one-call decode step over this pool, made at the first decode
        # eviction's scorer: ``first_tapped(seq)`` (the first position whose queries it wants, or None) and
        # ``queries(seq, cache_positions, per-layer queries)``; None: no queries are kept
        self.taps = None
        self._fused_made = False

    @property
    def fused(self) -> bool:
        """Whether decode steps run every layer in one native call (``CausalLM.fused_decoder``)."""
        return self._fused is not None

    def _tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        return torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int64)

    def prefill(self, seqs: list[Sequence], all_logits: bool = False, lengths: list[int] | None = None) -> torch.Tensor:
        """Run the next ``lengths[i]`` uncached tokens of each sequence (default: all of them)
        -> logits (B, V) at each chunk's last token, or (B, T, V) at every position with ``all_logits``.

        Rows are right-padded to the longest chunk of their pass; pad tokens are never written to the
        cache and every real token keeps its own absolute position. Chunks of very different lengths run
        in separate passes (``pad_groups``): a 16-token chunk beside a 4,080-token one would otherwise
        cost 4,080 rows of every linear.
        """
        if lengths is None:
            lengths = [len(s) - s.num_cached for s in seqs]
        groups = pad_groups(lengths)
        if len(groups) == 1:
            return self._prefill(seqs, lengths, all_logits)
        outs = [(g, self._prefill([seqs[i] for i in g], [lengths[i] for i in g], all_logits)) for g in groups]
        first = outs[0][1]
        shape = (len(seqs), max(lengths), first.shape[-1]) if all_logits else (len(seqs), first.shape[-1])
        logits = first.new_zeros(shape)
        for g, out in outs:
            for j, i in enumerate(g):
                if all_logits:
                    logits[i, : out.shape[1]] = out[j]  # (T_pass, V) of this row's pass
                else:
                    logits[i] = out[j]
        return logits

    def _prefill(self, seqs: list[Sequence], lengths: list[int], all_logits: bool) -> torch.Tensor:
        bs = self.block_size
        chunks = [s.token_ids[s.num_cached: s.num_cached + n] for s, n in zip(seqs, lengths)]
        T = max(len(c) for c in chunks)
        ids, pos, valid, slots, tapped = [], [], [], [], []
        for b, (s, c) in enumerate(zip(seqs, chunks)):
            ids.append(c + [0] * (T - len(c)))
            start = s.num_cached
            pos.append(list(range(start, start + T)))
            valid.extend(b * T + t for t in range(len(c)))
            slots.extend(s.block_table[p // bs] * bs + p % bs for p in range(s.kv_len, s.kv_len + len(c)))
            first = None if self.taps is None else self.taps.first_tapped(s)
            if first is not None:
                tapped.extend((b, t) for t in range(max(first - start, 0), len(c)))
        padded = len(valid) != len(seqs) * T
        evicted = torch.tensor([s.evicted for s in seqs], dtype=torch.int64)
        positions = torch.tensor(pos, dtype=torch.int64)  # (B, T)
        meta = AttnMetadata(
            positions=positions,
            valid_index=torch.tensor(valid, dtype=torch.int64) if padded else None,
            query_valid=torch.tensor([[t < len(c) for t in range(T)] for c in chunks]) if padded else None,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=self._tables(seqs),
            context_lens=torch.tensor([s.kv_len + len(c) for s, c in zip(seqs, chunks)], dtype=torch.int64),
            block_size=bs,
            kv_slots=torch.tensor([s.kv_slot for s in seqs], dtype=torch.int64),
            new_tokens=torch.tensor([len(c) for c in chunks], dtype=torch.int64),
            cache_positions=positions - evicted[:, None] if bool(evicted.any()) else None,
            tap=QueryTap(torch.tensor([b * T + t for b, t in tapped], dtype=torch.int64)) if tapped else None,
        )
        last = torch.tensor([len(c) - 1 for c in chunks], dtype=torch.int64)
        logits = self.model(torch.tensor(ids, dtype=torch.int64), meta, self.pool.layers,
                            logits_index=None if all_logits else last)
        if meta.tap is not None:
            self._hand_over(seqs, tapped, meta)
        for s, c in zip(seqs, chunks):
            s.num_cached += len(c)
        return logits

    def _hand_over(self, seqs: list[Sequence], tapped: list[tuple[int, int]], meta: AttnMetadata) -> None:
        """Give each sequence's tapped queries (every layer's) with their cache indices to the taps' owner."""
        rows = torch.tensor([b for b, _ in tapped])
        cache_pos = meta.kv_positions.reshape(-1)[meta.tap.index]
        for b, s in enumerate(seqs):
            sel = (rows == b).nonzero().flatten()
            if sel.numel():
                self.taps.queries(s, cache_pos[sel], [q[sel] for q in meta.tap.queries])

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each sequence's newest token -> logits (B, V)."""
        bs = self.block_size
        pos = [len(s) - 1 for s in seqs]
        kv_pos = [p - s.evicted for s, p in zip(seqs, pos)]  # the new token's index in its cache
        tapped = [] if self.taps is None else [(b, 0) for b, s in enumerate(seqs)
                                               if self.taps.first_tapped(s) is not None]
        meta = AttnMetadata(
            positions=torch.tensor(pos, dtype=torch.int64)[:, None],  # (B, 1)
            slot_mapping=torch.tensor([s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, kv_pos)],
                                      dtype=torch.int64),
            block_tables=self._tables(seqs),
            context_lens=torch.tensor([p + 1 for p in kv_pos], dtype=torch.int64),
            block_size=bs,
            kv_slots=torch.tensor([s.kv_slot for s in seqs], dtype=torch.int64),
            new_tokens=torch.ones(len(seqs), dtype=torch.int64),
            cache_positions=torch.tensor(kv_pos, dtype=torch.int64)[:, None] if kv_pos != pos else None,
            tap=QueryTap(torch.tensor([b for b, _ in tapped], dtype=torch.int64)) if tapped else None,
        )
        ids = torch.tensor([[s.token_ids[-1]] for s in seqs], dtype=torch.int64)
        if not self._fused_made:
            self._fused, self._fused_made = self.model.fused_decoder(self.pool.layers), True
        fused = self._fused if meta.tap is None else None  # the one-call step exposes no queries
        logits = self.model(ids, meta, self.pool.layers, logits_index=torch.zeros(len(seqs), dtype=torch.int64),
                            fused=fused)
        if meta.tap is not None:
            self._hand_over(seqs, tapped, meta)
        for s in seqs:
            s.num_cached = len(s)
        return logits
