"""Per-layer views of the engine's preallocated block pool.

The pool for one layer is a pair of tensors (num_blocks, block_size, n_kv, head_dim).
New keys and values are written in place at their slots (block * block_size + offset);
reads gather whole blocks through each sequence's block table. K/V are stored once per
KV head: grouped-query attention never materialises the repeated heads.
"""

from __future__ import annotations

import torch


class BlockKV:
    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k = k  # (num_blocks, bs, nkv, hd)
        self.v = v

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots (N,), k/v (N, nkv, hd): copy into the pool in place."""
        nkv, hd = self.k.shape[2], self.k.shape[3]
        self.k.view(-1, nkv, hd).index_copy_(0, slots, k)
        self.v.view(-1, nkv, hd).index_copy_(0, slots, v)

    def read(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_tables (B, nblk) -> k, v (B, nkv, nblk * bs, hd)."""
        B, nblk = block_tables.shape
        bs, nkv, hd = self.k.shape[1:]
        k = self.k[block_tables].view(B, nblk * bs, nkv, hd).transpose(1, 2)
        v = self.v[block_tables].view(B, nblk * bs, nkv, hd).transpose(1, 2)
        return k, v
