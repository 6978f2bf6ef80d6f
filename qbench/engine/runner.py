"""Turns a list of sequences into one forward pass: ids, positions, slots and block tables."""

from __future__ import annotations

import torch

from qbench.engine.kv_cache import KVPool
from qbench.engine.sequence import Sequence
from qbench.layers.attention import AttnMetadata
from qbench.models.base import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool):
        self.model = model
        self.pool = pool
        self.block_size = pool.block_size

    def _tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        return torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int64)

    def prefill(self, seqs: list[Sequence], all_logits: bool = False, lengths: list[int] | None = None) -> torch.Tensor:
        """Run the next ``lengths[i]`` uncached tokens of each sequence (default: all of them) in one pass
        -> logits (B, V) at each chunk's last token, or (B, T, V) at every position with ``all_logits``.

        Rows are right-padded to the longest chunk; pad tokens are never written to the cache
        and every real token keeps its own absolute position.
        """
        bs = self.block_size
        if lengths is None:
            lengths = [len(s) - s.num_cached for s in seqs]
        chunks = [s.token_ids[s.num_cached: s.num_cached + n] for s, n in zip(seqs, lengths)]
        T = max(len(c) for c in chunks)
        ids, pos, valid, slots = [], [], [], []
        for b, (s, c) in enumerate(zip(seqs, chunks)):
            ids.append(c + [0] * (T - len(c)))
            start = s.num_cached
            pos.append(list(range(start, start + T)))
            valid.extend(b * T + t for t in range(len(c)))
            slots.extend(s.block_table[p // bs] * bs + p % bs for p in range(start, start + len(c)))
        padded = len(valid) != len(seqs) * T
        meta = AttnMetadata(
            positions=torch.tensor(pos, dtype=torch.int64),  # (B, T)
            valid_index=torch.tensor(valid, dtype=torch.int64) if padded else None,
            query_valid=torch.tensor([[t < len(c) for t in range(T)] for c in chunks]) if padded else None,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=self._tables(seqs),
            context_lens=torch.tensor([s.num_cached + len(c) for s, c in zip(seqs, chunks)], dtype=torch.int64),
            block_size=bs,
            kv_slots=torch.tensor([s.kv_slot for s in seqs], dtype=torch.int64),
            new_tokens=torch.tensor([len(c) for c in chunks], dtype=torch.int64),
        )
        last = torch.tensor([len(c) - 1 for c in chunks], dtype=torch.int64)
        logits = self.model(torch.tensor(ids, dtype=torch.int64), meta, self.pool.layers,
                            logits_index=None if all_logits else last)
        for s, c in zip(seqs, chunks):
            s.num_cached += len(c)
        return logits

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each sequence's newest token -> logits (B, V)."""
        bs = self.block_size
        pos = [len(s) - 1 for s in seqs]
        meta = AttnMetadata(
            positions=torch.tensor(pos, dtype=torch.int64)[:, None],  # (B, 1)
            slot_mapping=torch.tensor([s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos)],
                                      dtype=torch.int64),
            block_tables=self._tables(seqs),
            context_lens=torch.tensor([p + 1 for p in pos], dtype=torch.int64),
            block_size=bs,
            kv_slots=torch.tensor([s.kv_slot for s in seqs], dtype=torch.int64),
            new_tokens=torch.ones(len(seqs), dtype=torch.int64),
        )
        ids = torch.tensor([[s.token_ids[-1]] for s in seqs], dtype=torch.int64)
        logits = self.model(ids, meta, self.pool.layers, logits_index=torch.zeros(len(seqs), dtype=torch.int64))
        for s in seqs:
            s.num_cached = len(s)
        return logits
