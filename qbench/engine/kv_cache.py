"""The preallocated KV pool: every layer's blocks, allocated once and written in place."""

from __future__ import annotations

import torch

from qbench.layers.kv import BlockKV


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype):
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: masked slots are multiplied by 0 in attention and must not hold NaN bits
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layers = [BlockKV(self.k[i], self.v[i]) for i in range(num_layers)]

    @property
    def bytes_per_token(self) -> int:
        l, _, _, nkv, hd = self.k.shape
        return 2 * l * nkv * hd * self.k.element_size()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size
