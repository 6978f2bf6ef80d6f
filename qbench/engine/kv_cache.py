"""The preallocated KV pool: every layer's blocks, allocated once and written in place."""

from __future__ import annotations

import torch

from qbench.layers.kv import BlockKV, QuantBlockKV
from qbench.layers.kvquant import KVScheme


class QuantKVPool:
    """A KIVI-quantized pool: every layer's quantized blocks, plus one full-precision residual block per
    sequence slot (the tokens of each sequence's unfinished block)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, scheme: KVScheme, max_seqs: int):
        if scheme.group != block_size or scheme.residual != block_size:
            raise ValueError(f"KV group and residual window must equal the block size ({block_size}) for now")
        L, nb, bs, nkv, hd = num_layers, num_blocks, block_size, num_kv_heads, head_dim
        u8, f16 = torch.uint8, torch.float16
        self.store = {
            "kq": torch.zeros(L, nb, bs, nkv, hd * scheme.k_bits // 8, dtype=u8),
            "k_scale": torch.zeros(L, nb, nkv, hd, dtype=f16), "k_min": torch.zeros(L, nb, nkv, hd, dtype=f16),
            "vq": torch.zeros(L, nb, bs, nkv, hd * scheme.v_bits // 8, dtype=u8),
            "v_scale": torch.zeros(L, nb, bs, nkv, hd // scheme.v_group, dtype=f16),
            "v_min": torch.zeros(L, nb, bs, nkv, hd // scheme.v_group, dtype=f16),
            "rk": torch.zeros(L, max_seqs, bs, nkv, hd, dtype=dtype),
            "rv": torch.zeros(L, max_seqs, bs, nkv, hd, dtype=dtype),
        }
        self.num_blocks, self.block_size, self.scheme = num_blocks, block_size, scheme
        self.layers = [QuantBlockKV({k: t[i] for k, t in self.store.items()}, scheme) for i in range(L)]
        self.bytes_per_token = scheme.bytes_per_token(L, nkv, hd, torch.empty(0, dtype=dtype).element_size())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.store.values())

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


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
