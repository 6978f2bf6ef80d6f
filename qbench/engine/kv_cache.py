"""The preallocated KV pool: every layer's blocks, allocated once and written in place."""

from __future__ import annotations

import torch

from qbench.layers.kv import BlockKV, QuantBlockKV
from qbench.layers.kvscheme import KVScheme


def quant_store_shapes(num_blocks: int, block_size: int, nkv: int, hd: int, dtype: torch.dtype,
                       scheme: KVScheme, max_seqs: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """One layer's tensors of a quantized pool: codes (c), scales (s) and minimums (m) of K and V per
    block, and the full-precision residual ring (rk, rv) of R / G blocks per sequence slot."""
    out = {}
    for prefix, codec in zip("kv", scheme.codecs()):
        code_dtype = dtype if codec.mode == "none" else torch.uint8
        out[prefix + "c"] = ((num_blocks, *codec.code_shape(block_size, nkv, hd)), code_dtype)
        stat = codec.stat_shape(block_size, nkv, hd)
        if stat is not None:
            out[prefix + "s"] = ((num_blocks, *stat), torch.float16)
            if codec.has_min:
                out[prefix + "m"] = ((num_blocks, *stat), torch.float16)
    for name in ("rk", "rv"):
        out[name] = ((max_seqs, scheme.windows, block_size, nkv, hd), dtype)
    return out


class QuantKVPool:
    """A quantized pool: every layer's quantized blocks plus the residual ring of each sequence slot."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, scheme: KVScheme, max_seqs: int):
        scheme.check(block_size, head_dim)
        shapes = quant_store_shapes(num_blocks, block_size, num_kv_heads, head_dim, dtype, scheme, max_seqs)
        self.store = {k: torch.zeros((num_layers, *shape), dtype=dt) for k, (shape, dt) in shapes.items()}
        self.num_blocks, self.block_size, self.scheme = num_blocks, block_size, scheme
        self.layers = [QuantBlockKV({k: t[i] for k, t in self.store.items()}, scheme) for i in range(num_layers)]
        fp = torch.empty(0, dtype=dtype).element_size()
        self.bytes_per_token = scheme.bytes_per_token(num_layers, num_kv_heads, head_dim, fp)
        self.residual_nbytes = self.store["rk"].nbytes + self.store["rv"].nbytes

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.store.values())

    @property
    def block_nbytes(self) -> int:
        return sum(t[:, 0].nbytes for k, t in self.store.items() if k not in ("rk", "rv"))

    def copy_block(self, src: int, dst: int) -> None:
        for k, t in self.store.items():
            if k not in ("rk", "rv"):
                t[:, dst] = t[:, src]

    def adopt(self, old: "QuantKVPool") -> None:
        """Take over a smaller pool's blocks (same ids) and residual rings."""
        for k, t in self.store.items():
            src = old.store[k]
            t[:, : src.shape[1]] = src

    def copy_slot(self, src: int, dst: int) -> None:
        """A forked sequence's residual ring starts as its parent's."""
        for k in ("rk", "rv"):
            self.store[k][:, dst] = self.store[k][:, src]

    def read_sequence(self, layer: int, table: list[int], n: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first n cached tokens in one layer, dequantized -> k, v (n, nkv, hd)."""
        meta = _OneSequence(table, n, slot)
        k, v = self.layers[layer].read_meta(meta)  # (1, nkv, nblk * bs, hd)
        return k[0, :, :n].transpose(0, 1), v[0, :, :n].transpose(0, 1)

    def read_keys(self, layer: int, table: list[int], n: int, slot: int) -> torch.Tensor:
        """``read_sequence``'s keys alone (V is not dequantized) -> (n, nkv, hd)."""
        k, _ = self.layers[layer].read_meta(_OneSequence(table, n, slot), keys_only=True)
        return k[0, :, :n].transpose(0, 1)

    def compact(self, src_table: list[int], keep: torch.Tensor, dst_table: list[int], n: int, slot: int) -> None:
        """Eviction on a quantized pool: the kept cache indices ``keep`` (L, nkv, m) of a sequence of n tokens are
        dequantized, then stored again as its first m tokens in ``dst_table`` as any write stores them: whole
        blocks outside the residual window quantized (a second rounding for tokens that were quantized
        already), the rest in its ring."""
        head = torch.arange(keep.shape[1])[:, None]
        for i, layer in enumerate(self.layers):
            k, v = self.read_sequence(i, src_table, n, slot)  # (n, nkv, hd)
            kk, vv = (t[keep[i], head].transpose(0, 1).contiguous() for t in (k, v))  # (m, nkv, hd)
            layer.store_sequence(dst_table, kk, vv, slot)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


class _OneSequence:
    """The metadata ``QuantBlockKV.read_meta`` needs to read one sequence."""

    def __init__(self, table: list[int], n: int, slot: int):
        self.block_tables = torch.tensor([table], dtype=torch.int64)
        self.context_lens = torch.tensor([n], dtype=torch.int64)
        self.kv_slots = torch.tensor([slot], dtype=torch.int64)


def blocks_in_budget(budget_bytes: int, num_layers: int, block_size: int, nkv: int, hd: int, dtype: torch.dtype,
                     scheme: KVScheme | None, max_seqs: int) -> int:
    """How many blocks a pool of ``budget_bytes`` holds, the residual ring of a quantized pool included."""
    fp = torch.empty(0, dtype=dtype).element_size()
    if scheme is None:
        per_block, fixed = 2 * num_layers * block_size * nkv * hd * fp, 0
    else:
        per_block = round(scheme.bytes_per_token(num_layers, nkv, hd, fp) * block_size)
        fixed = max_seqs * scheme.residual_bytes(num_layers, nkv, hd, fp)
    return max(0, (budget_bytes - fixed) // per_block)


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
    def block_nbytes(self) -> int:
        return self.k[:, 0].nbytes + self.v[:, 0].nbytes

    def copy_block(self, src: int, dst: int) -> None:
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def adopt(self, old: "KVPool") -> None:
        """Take over a smaller pool's blocks, under the same ids."""
        self.k[:, : old.num_blocks] = old.k
        self.v[:, : old.num_blocks] = old.v

    def copy_slot(self, src: int, dst: int) -> None:
        pass  # no residual ring in a full-precision pool

    def read_sequence(self, layer: int, table: list[int], n: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first n cached tokens in one layer -> k, v (n, nkv, hd)."""
        t = torch.tensor(table, dtype=torch.int64)
        return tuple(x[layer][t].reshape(-1, *x.shape[3:])[:n] for x in (self.k, self.v))

    def read_keys(self, layer: int, table: list[int], n: int, slot: int) -> torch.Tensor:
        """One sequence's first n cached keys in one layer -> (n, nkv, hd)."""
        t = torch.tensor(table, dtype=torch.int64)
        return self.k[layer][t].reshape(-1, *self.k.shape[3:])[:n]

    def compact(self, src_table: list[int], keep: torch.Tensor, dst_table: list[int], n: int = 0,
                slot: int = 0) -> None:
        """Eviction: the cache indices ``keep`` (L, nkv, m) of a sequence's blocks ``src_table``, per layer and KV
        head, become its first m tokens in ``dst_table``, in every layer at once. Everything is read before
        anything is written, so the two tables may share blocks."""
        L, nb, bs, nkv, hd = self.k.shape
        m = keep.shape[2]
        src = torch.tensor(src_table, dtype=torch.int64)
        slots = src[keep // bs] * bs + keep % bs  # (L, nkv, m) flat slots in the pool
        layer = torch.arange(L)[:, None, None]
        head = torch.arange(nkv)[None, :, None]
        j = torch.arange(m)
        dst = torch.tensor(dst_table, dtype=torch.int64)[j // bs] * bs + j % bs  # (m,)
        for t in (self.k, self.v):
            flat = t.view(L, nb * bs, nkv, hd)
            kept = flat[layer, slots, head]  # (L, nkv, m, hd): a copy
            flat[:, dst] = kept.transpose(1, 2)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size
