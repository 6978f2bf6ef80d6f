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


class QuantBlockKV:
    """Per-layer view of a quantized block pool (KIVI): K and V of each completed block stored through
    the scheme's codecs, and each sequence's newest tokens in a full-precision residual ring of R / G
    blocks. A block is quantized exactly once, when it leaves the residual window; its bytes never change
    after that.
    """

    native = False  # attention reads it through ``read_meta``, not the native kernel

    def __init__(self, store: dict, scheme):
        self.s = store  # this layer's tensors: kc, ks, km, vc, vs, vm (codes, scale, min), rk, rv (residual)
        self.scheme = scheme
        self.kcodec, self.vcodec = scheme.codecs()
        self.windows = scheme.windows

    @property
    def block_size(self) -> int:
        return self.s["rk"].shape[2]

    def quantized_blocks(self, n: int) -> int:
        """Blocks of a sequence of n tokens that are stored quantized: all but the residual window."""
        return max(0, n // self.block_size - (self.windows - 1))

    def _store(self, prefix: str, codec, block: int, x: torch.Tensor) -> None:
        q = codec.quantize(x)
        self.s[prefix + "c"][block] = q.codes
        if q.scale is not None:
            self.s[prefix + "s"][block] = q.scale
        if q.minimum is not None:
            self.s[prefix + "m"][block] = q.minimum

    def write_meta(self, meta, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (N, nkv, hd): the real new tokens of this step, sequence by sequence in position order."""
        bs, W = self.block_size, self.windows
        rk, rv = self.s["rk"], self.s["rv"]  # (seqs, W, bs, nkv, hd)
        ctx, slots, counts = meta.context_lens.tolist(), meta.kv_slots.tolist(), meta.new_tokens.tolist()
        tables = meta.block_tables
        start = 0
        for b, n in enumerate(counts):
            before, after, r = ctx[b] - n, ctx[b], slots[b]
            kb, vb = k[start: start + n], v[start: start + n]
            start += n
            qa = self.quantized_blocks(after)
            for j in range(self.quantized_blocks(before), qa):  # blocks that leave the window now
                lo = j * bs
                old = min(max(before - lo, 0), bs)  # tokens of block j already in the ring
                new = slice(lo + old - before, lo + bs - before)
                fk = torch.cat([rk[r, j % W, :old], kb[new]]) if old else kb[new]
                fv = torch.cat([rv[r, j % W, :old], vb[new]]) if old else vb[new]
                blk = int(tables[b, j])
                self._store("k", self.kcodec, blk, fk)
                self._store("v", self.vcodec, blk, fv)
            for p0 in range(max(before, qa * bs), after, bs):  # the rest goes into the ring, block by block
                j, off = p0 // bs, p0 % bs
                p1 = min(after, (j + 1) * bs)
                rk[r, j % W, off: off + p1 - p0] = kb[p0 - before: p1 - before]
                rv[r, j % W, off: off + p1 - p0] = vb[p0 - before: p1 - before]

    def read_meta(self, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """-> k, v (B, nkv, nblk * bs, hd) in full precision: dequantized blocks plus the residual ring."""
        bt = meta.block_tables
        B, nblk = bt.shape
        s = self.s
        bs, nkv, hd = s["rk"].shape[2:]

        def load(prefix: str, codec) -> torch.Tensor:  # (B, nblk, bs, nkv, hd)
            stat = [s[prefix + x][bt] if prefix + x in s else None for x in ("s", "m")]
            return codec.dequantize(s[prefix + "c"][bt], *stat)

        k, v = load("k", self.kcodec), load("v", self.vcodec)
        ctx = meta.context_lens
        nq = (ctx // bs - (self.windows - 1)).clamp(min=0)  # (B,) quantized blocks per row
        used = (ctx + bs - 1) // bs
        j = torch.arange(nblk)
        rows, cols = ((j[None] >= nq[:, None]) & (j[None] < used[:, None])).nonzero(as_tuple=True)
        if rows.numel():
            ring = (meta.kv_slots[rows], cols % self.windows)
            k[rows, cols] = s["rk"][ring].float()
            v[rows, cols] = s["rv"][ring].float()
        k = k.view(B, nblk * bs, nkv, hd).transpose(1, 2)
        v = v.view(B, nblk * bs, nkv, hd).transpose(1, 2)
        return k, v
