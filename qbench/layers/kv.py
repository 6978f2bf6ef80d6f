"""Per-layer views of the engine's preallocated block pool.

The pool for one layer is a pair of tensors (num_blocks, block_size, n_kv, head_dim).
New keys and values are written in place at their slots (block * block_size + offset);
reads gather whole blocks through each sequence's block table. K/V are stored once per
KV head: grouped-query attention never materialises the repeated heads.
"""

from __future__ import annotations

import torch

from qbench.layers import kvquant as kq


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


class QuantBlockKV:
    """Per-layer view of a quantized block pool (KIVI): K per channel over each block's tokens, V per
    token in channel groups, and the tokens of each sequence's unfinished block in a full-precision
    residual slot. A block is quantized exactly once, when its last token is written; quantized bytes
    never change after that.
    """

    native = False  # attention reads it through ``read_meta``, not the native kernel

    def __init__(self, store: dict, scheme):
        self.s = store  # tensors of this layer: kq, k_scale, k_min, vq, v_scale, v_min, rk, rv
        self.scheme = scheme

    @property
    def block_size(self) -> int:
        return self.s["rk"].shape[1]

    def _quantize_block(self, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (bs, nkv, hd) full precision -> stored codes and statistics of ``block``."""
        sc = self.scheme
        qk = kq.quantize_k_per_channel(k, sc.k_bits)
        self.s["kq"][block] = qk.codes
        self.s["k_scale"][block], self.s["k_min"][block] = qk.scale, qk.minimum
        qv = kq.quantize_v_per_token(v, sc.v_bits, sc.v_group)
        self.s["vq"][block] = qv.codes
        self.s["v_scale"][block], self.s["v_min"][block] = qv.scale, qv.minimum

    def write_meta(self, meta, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (N, nkv, hd): the real new tokens of this step, sequence by sequence in position order."""
        bs = self.block_size
        rk, rv = self.s["rk"], self.s["rv"]
        ctx = meta.context_lens.tolist()
        slots = meta.kv_slots.tolist()
        counts = meta.new_tokens.tolist()
        tables = meta.block_tables
        start = 0
        for b, n in enumerate(counts):
            before, after, r = ctx[b] - n, ctx[b], slots[b]
            kb, vb = k[start: start + n], v[start: start + n]
            start += n
            for j in range(before // bs, after // bs):  # blocks that complete in this step
                lo = j * bs
                old = max(before - lo, 0)  # tokens of block j already in the residual slot
                take = slice(max(lo - before, 0), max(lo - before, 0) + bs - old)
                fk = torch.cat([rk[r, :old], kb[take]]) if old else kb[take]
                fv = torch.cat([rv[r, :old], vb[take]]) if old else vb[take]
                self._quantize_block(int(tables[b, j]), fk, fv)
            tail = max(after // bs * bs, before)  # positions of the unfinished block written now
            if tail < after:
                off = tail % bs
                rk[r, off: off + after - tail] = kb[tail - before:]
                rv[r, off: off + after - tail] = vb[tail - before:]

    def read_meta(self, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """-> k, v (B, nkv, nblk * bs, hd) in full precision: dequantized blocks plus the residual."""
        bt = meta.block_tables
        B, nblk = bt.shape
        s, sc = self.s, self.scheme
        bs, nkv, hd = s["rk"].shape[1:]
        k = kq.unpack_bits(s["kq"][bt], sc.k_bits).float() * s["k_scale"][bt].float()[:, :, None] \
            + s["k_min"][bt].float()[:, :, None]  # (B, nblk, bs, nkv, hd)
        g = hd // s["v_scale"].shape[-1]
        vc = kq.unpack_bits(s["vq"][bt], sc.v_bits).float().view(B, nblk, bs, nkv, -1, g)
        v = (vc * s["v_scale"][bt].float()[..., None] + s["v_min"][bt].float()[..., None]).view(B, nblk, bs, nkv, hd)
        ctx = meta.context_lens
        partial = (ctx % bs) != 0
        if bool(partial.any()):
            rows = partial.nonzero()[:, 0]
            last = ctx[rows] // bs
            k[rows, last] = s["rk"][meta.kv_slots[rows]].float()
            v[rows, last] = s["rv"][meta.kv_slots[rows]].float()
        k = k.view(B, nblk * bs, nkv, hd).transpose(1, 2)
        v = v.view(B, nblk * bs, nkv, hd).transpose(1, 2)
        return k, v
