"""Per-layer views of the engine's preallocated block pool.

The pool for one layer is a pair of tensors (num_blocks, block_size, n_kv, head_dim).
New keys and values are written in place at their slots (block * block_size + offset);
reads gather whole blocks through each sequence's block table. K/V are stored once per
KV head: grouped-query attention never materialises the repeated heads.
"""

from __future__ import annotations

import torch

from qbench.kernels import build as kernels
from qbench.kernels import ops


class BlockKV:
    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k = k  # (num_blocks, bs, nkv, hd)
        self.v = v

    @property
    def native(self) -> bool:
        """An fp32 pool is read by the paged kernel, an fp16/bf16 one by qb_attention_kv: no mask needed."""
        return self.k.dtype == torch.float32 or (kernels.available() and ops.fp_mode(self.k.dtype) is not None
                                                 and ops.kv_kernel_fits(self.k.shape[3]))

    def sources(self) -> tuple[tuple, tuple]:
        """K and V as qb_attention_kv reads them (an fp16 or bf16 pool)."""
        mode = ops.fp_mode(self.k.dtype)
        return ops.kv_source(mode, codes=self.k), ops.kv_source(mode, codes=self.v)

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots (N,), k/v (N, nkv, hd): copy into the pool in place."""
        nkv, hd = self.k.shape[2], self.k.shape[3]
        self.k.view(-1, nkv, hd).index_copy_(0, slots, k.to(self.k.dtype))
        self.v.view(-1, nkv, hd).index_copy_(0, slots, v.to(self.v.dtype))

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

    native = False  # the fp32 paged kernels cannot read it; qb_attention_kv does (``decode_kernel``), else read_meta

    def __init__(self, store: dict, scheme):
        self.s = store  # this layer's tensors: kc, ks, km, vc, vs, vm (codes, scale, min), rk, rv (residual)
        self.scheme = scheme
        self.kcodec, self.vcodec = scheme.codecs()
        self.windows = scheme.windows
        src = self.sources()
        self._sources = src  # the store's tensors are fixed for the pool's life
        self._fits = (src is not None and store["rk"].dtype == torch.float32
                      and ops.kv_kernel_fits(store["rk"].shape[4], src))
        self._store_modes = None if src is None or any(m == ops.KV_FP8 for m, *_ in src) else src

    @property
    def native_store(self) -> bool:
        """Blocks are quantized by qb_kv_store (KIVI and unquantized layouts; FP8 stays in torch), the same bits
        as the codecs' ``quantize``."""
        return self._store_modes is not None and self._fits and kernels.available()

    @property
    def decode_kernel(self) -> bool:
        """Decode and prefill read the blocks in place through qb_attention_kv, where it takes the layout."""
        return self._fits and kernels.available()

    def sources(self) -> tuple[tuple, tuple] | None:
        """K and V as qb_attention_kv reads them; None for the layouts it does not take (the naive baselines:
        per-tensor, and per-token K)."""
        out = []
        for prefix, codec, ok in (("k", self.kcodec, ("none", "channel", "fp8")),
                                  ("v", self.vcodec, ("none", "token", "fp8"))):
            if codec.mode not in ok:
                return None
            codes = self.s[prefix + "c"]
            if codec.mode == "none":
                out.append(ops.kv_source(ops.fp_mode(codes.dtype), codes=codes))
                continue
            mode = {"channel": ops.KV_CHANNEL, "token": ops.KV_TOKEN, "fp8": ops.KV_FP8}[codec.mode]
            out.append(ops.kv_source(mode, codec.bits, codes, self.s[prefix + "s"], self.s.get(prefix + "m"),
                                     codec.group))
        return out[0], out[1]

    def attend_decode(self, q: torch.Tensor, meta, window: int | None, scale: float) -> torch.Tensor:
        """q (B, T, nh, hd) over this step's cache (written first) -> (B, T, nh * hd), no dequantized copy: a
        decode step's query, or a prefill's, each over the keys up to its position."""
        k_src, v_src = self._sources
        return ops.attention_kv(q, meta.block_tables, meta.kv_positions, meta.query_valid, meta.context_lens, k_src,
                                v_src, self.s["rk"], self.s["rv"], meta.kv_slots, window, scale)

    @property
    def block_size(self) -> int:
        return self.s["rk"].shape[2]

    def quantized_blocks(self, n: int) -> int:
        """Blocks of a sequence of n tokens that are stored quantized: all but the residual window."""
        return max(0, n // self.block_size - (self.windows - 1))

    def _store(self, prefix: str, codec, block, x: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Quantize x (G, nkv, hd) into pool block ``block``, or x (n, G, nkv, hd) into a tensor of n blocks; with
        ``rows``, x is (m, G, nkv, hd) and block i is x[rows[i]]."""
        if self.native_store and x.dtype == torch.float32:
            mode, bits, group, codes, scale, minimum = self._store_modes[prefix == "v"]
            blocks = torch.as_tensor(block, dtype=torch.int64).reshape(-1)
            ops.kv_store(x.reshape(-1, *x.shape[-3:]), rows, blocks, mode, bits, group, codes, scale, minimum)
            return
        if rows is not None:
            x = x[rows]
        q = codec.quantize(x)
        self.s[prefix + "c"][block] = q.codes
        if q.scale is not None:
            self.s[prefix + "s"][block] = q.scale
        if q.minimum is not None:
            self.s[prefix + "m"][block] = q.minimum

    def write_meta(self, meta, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (N, nkv, hd): the real new tokens of this step, sequence by sequence in position order."""
        plan = self.decode_plan(meta)
        if plan is not None:
            return self._write_decode(plan, k, v)
        bs, W = self.block_size, self.windows
        rk, rv = self.s["rk"], self.s["rv"]  # (seqs, W, bs, nkv, hd)
        ctx, slots, counts = meta.context_lens.tolist(), meta.kv_slots.tolist(), meta.new_tokens.tolist()
        tables = meta.block_tables
        leaving: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (pool block, k, v) of each block that leaves
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
                # a copy of the ring's part now: the ring rows written below may reuse its slot
                fk = torch.cat([rk[r, j % W, :old], kb[new]]) if old else kb[new]
                fv = torch.cat([rv[r, j % W, :old], vb[new]]) if old else vb[new]
                leaving.append((int(tables[b, j]), fk, fv))
            self._write_ring(r, kb, vb, max(before, qa * bs), after, before)  # the rest
        if leaving:  # every row's leaving blocks in one call per codec: a prefill's are thousands (block-wise
            # statistics, so the codes and statistics are those of one call per block)
            blocks = torch.tensor([blk for blk, _, _ in leaving], dtype=torch.int64)
            self._store("k", self.kcodec, blocks, torch.stack([fk for _, fk, _ in leaving]))  # (n, bs, nkv, hd)
            self._store("v", self.vcodec, blocks, torch.stack([fv for _, _, fv in leaving]))

    def store_sequence(self, table: list[int], k: torch.Tensor, v: torch.Tensor, slot: int) -> None:
        """k, v (m, nkv, hd): a whole sequence's cache written afresh into ``table`` (eviction's compaction): the
        blocks outside the residual window quantized, the rest in ring slot ``slot``."""
        bs = self.block_size
        m = k.shape[0]
        qa = self.quantized_blocks(m)
        if qa:
            blocks = torch.tensor(table[:qa], dtype=torch.int64)
            self._store("k", self.kcodec, blocks, k[: qa * bs].view(qa, bs, *k.shape[1:]))
            self._store("v", self.vcodec, blocks, v[: qa * bs].view(qa, bs, *v.shape[1:]))
        self._write_ring(slot, k, v, qa * bs, m, 0)

    def _write_ring(self, slot: int, k: torch.Tensor, v: torch.Tensor, first: int, end: int, base: int) -> None:
        """Positions [first, end) of one sequence into its ring ``slot``, block by block; k, v (n, nkv, hd) hold
        position p at row p - base. The first piece may start inside a block; each ends at the next block
        boundary."""
        bs, W = self.block_size, self.windows
        p0 = first
        while p0 < end:
            j, off = p0 // bs, p0 % bs
            p1 = min(end, (j + 1) * bs)
            self.s["rk"][slot, j % W, off: off + p1 - p0] = k[p0 - base: p1 - base]
            self.s["rv"][slot, j % W, off: off + p1 - p0] = v[p0 - base: p1 - base]
            p0 = p1

    def decode_plan(self, meta) -> tuple | None:
        """Where a decode step's tokens go, the same for every layer (computed once, kept on ``meta``): ring
        rows (flat) and the blocks that leave the window (ring slot -> pool block). None: a step that writes
        more than one token to some row (a prefill), which takes the general path."""
        plan = meta.kv_plan
        if plan is not None and plan[0] == (self.block_size, self.windows):
            return plan[1]
        bs, W = self.block_size, self.windows
        counts = None if meta.new_tokens is None else meta.new_tokens.tolist()
        if counts is None or any(n > 1 for n in counts):
            meta.kv_plan = ((bs, W), None)
            return None
        # a few integers a row: plain Python, cheaper than a dozen small torch operations at these sizes
        ctx, slots = meta.context_lens.tolist(), meta.kv_slots.tolist()
        rows, ring_slot, leave_row, leave_j = [], [], [], []
        for b, n in enumerate(counts):
            if not n:  # rows that write a token; k/v hold theirs in row order
                continue
            after, slot = ctx[b], slots[b]
            pos = after - 1  # the new token's position
            rows.append((slot * W + (pos // bs) % W) * bs + pos % bs)
            q_after, q_before = max(after // bs - (W - 1), 0), max(pos // bs - (W - 1), 0)
            if q_after > q_before:  # at most one block per row on a one-token step
                j = q_after - 1
                ring_slot.append(slot * W + j % W)
                leave_row.append(b)
                leave_j.append(j)
        ring_rows = torch.tensor(rows, dtype=torch.int64)
        leaving = (torch.tensor(ring_slot, dtype=torch.int64),
                   meta.block_tables[torch.tensor(leave_row), torch.tensor(leave_j)]) if leave_row else None
        meta.kv_plan = ((bs, W), (ring_rows, leaving))
        return meta.kv_plan[1]

    def _write_decode(self, plan: tuple, k: torch.Tensor, v: torch.Tensor) -> None:
        """One token per row at most: every token goes into its ring first; a block that leaves the window is
        then whole in its ring slot (a one-token step never writes the slot it frees) and is quantized from
        there, all rows' leaving blocks in one call per codec."""
        ring_rows, leaving = plan
        nkv, hd = self.s["rk"].shape[3:]
        for name, x in (("rk", k), ("rv", v)):
            self.s[name].view(-1, nkv, hd).index_copy_(0, ring_rows, x.to(self.s[name].dtype))
        self.store_leaving(leaving)

    def store_leaving(self, leaving: tuple | None) -> None:
        """Quantize the blocks that leave the window on a decode step (``decode_plan``'s second part), from their
        ring slots into their pool blocks."""
        if leaving is None:
            return
        bs, nkv, hd = self.s["rk"].shape[2:]
        ring_slot, blocks = leaving
        for prefix, codec, name in (("k", self.kcodec, "rk"), ("v", self.vcodec, "rv")):
            ring = self.s[name].view(-1, bs, nkv, hd)  # (seqs * W, bs, nkv, hd): every ring slot
            self._store(prefix, codec, blocks, ring, rows=ring_slot)

    def read_meta(self, meta, keys_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> k, v (B, nkv, nblk * bs, hd) in full precision: dequantized blocks plus the residual ring (v None
        with ``keys_only``: eviction's scores read keys alone)."""
        bt = meta.block_tables
        B, nblk = bt.shape
        s = self.s
        bs, nkv, hd = s["rk"].shape[2:]

        def load(prefix: str, codec) -> torch.Tensor:  # (B, nblk, bs, nkv, hd)
            stat = [s[prefix + x][bt] if prefix + x in s else None for x in ("s", "m")]
            return codec.dequantize(s[prefix + "c"][bt], *stat)

        k, v = load("k", self.kcodec), None if keys_only else load("v", self.vcodec)
        ctx = meta.context_lens
        nq = (ctx // bs - (self.windows - 1)).clamp(min=0)  # (B,) quantized blocks per row
        used = (ctx + bs - 1) // bs
        j = torch.arange(nblk)
        rows, cols = ((j[None] >= nq[:, None]) & (j[None] < used[:, None])).nonzero(as_tuple=True)
        if rows.numel():
            ring = (meta.kv_slots[rows], cols % self.windows)
            k[rows, cols] = s["rk"][ring].float()
            if v is not None:
                v[rows, cols] = s["rv"][ring].float()
        k = k.view(B, nblk * bs, nkv, hd).transpose(1, 2)
        return k, None if v is None else v.view(B, nblk * bs, nkv, hd).transpose(1, 2)
