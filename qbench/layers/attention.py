"""Attention over the block cache, with its metadata passed explicitly.

Each query token carries its absolute position, so prompts of different lengths in one
batch rotate and mask correctly without any left-padding arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qbench.kernels import build as kernels
from qbench.kernels.ops import MAX_GROUP, attention_kv, paged_attention, prefill_attention
from qbench.layers import prefill_attention as prefill
from qbench.layers.kv import BlockKV, QuantBlockKV


@dataclass
class AttnMetadata:
    positions: torch.Tensor  # (B, T) int64 absolute position of every query token
    valid_index: torch.Tensor | None = None  # (N,) flat indices of real tokens in (B*T); None: all real
    slot_mapping: torch.Tensor | None = None  # (N,) cache slots for those tokens; None: no cache
    block_tables: torch.Tensor | None = None  # (B, nblk) int64
    context_lens: torch.Tensor | None = None  # (B,) tokens in the cache once this step is written
    key_valid: torch.Tensor | None = None  # (B, T) bool, real tokens, for the cache-free path
    query_valid: torch.Tensor | None = None  # (B, T) bool, real query tokens when rows are padded
    block_size: int = 0
    kv_slots: torch.Tensor | None = None  # (B,) each sequence's residual slot in a quantized cache
    new_tokens: torch.Tensor | None = None  # (B,) real tokens each sequence writes in this step
    kv_plan: tuple | None = None  # a quantized cache's write plan for this step, shared by the layers
    # (B, T) each query's index in its sequence's cache, where eviction has made it differ from its position
    # (RoPE and learned positions read ``positions``; masks and the cache read these); None: the same
    cache_positions: torch.Tensor | None = None
    tap: "QueryTap | None" = None  # collects some queries of every layer (eviction scores)

    @property
    def kv_positions(self) -> torch.Tensor:
        return self.positions if self.cache_positions is None else self.cache_positions

    @property
    def uses_cache(self) -> bool:
        return self.slot_mapping is not None


class QueryTap:
    """Keeps the rotated queries of some rows (flat indices into B * T) from every layer, in layer order."""

    def __init__(self, index: torch.Tensor):
        self.index = index  # (n,)
        self.queries: list[torch.Tensor] = []  # per layer (n, nh, hd)

    def add(self, q: torch.Tensor) -> None:
        B, T, nh, hd = q.shape
        self.queries.append(q.reshape(B * T, nh, hd).index_select(0, self.index).float())


def uses_kernel(meta: AttnMetadata, dtype: torch.dtype) -> bool:
    """The native kernel reads K/V from the pool directly; it needs no dense mask."""
    return meta.uses_cache and dtype == torch.float32 and kernels.available()


def _query_valid(meta: AttnMetadata, T: int) -> torch.Tensor | None:
    """(B, T) real query rows of a prefill: ``query_valid``, else the first ``new_tokens`` of each row."""
    if meta.query_valid is not None:
        return meta.query_valid
    if meta.new_tokens is None:
        return None
    return torch.arange(T)[None, :] < meta.new_tokens[:, None]


def build_mask(meta: AttnMetadata, group: int, sliding_window: int | None = None) -> torch.Tensor:
    """Boolean mask (B, 1, T * group, L); True where a query may attend a key."""
    qpos = meta.kv_positions  # (B, T)
    B, T = qpos.shape
    if meta.uses_cache:
        L = meta.block_tables.shape[1] * meta.block_size
        kpos = torch.arange(L, dtype=qpos.dtype).expand(B, L)
        kvalid = kpos < meta.context_lens[:, None]
    else:
        kpos = qpos
        kvalid = meta.key_valid if meta.key_valid is not None else torch.ones_like(qpos, dtype=torch.bool)
    diff = qpos[:, :, None] - kpos[:, None, :]  # (B, T, L)
    mask = kvalid[:, None, :] & (diff >= 0)
    if sliding_window is not None:
        mask &= diff < sliding_window
    # padded query rows may see nothing; let them see key 0 so softmax stays finite
    mask[..., 0] |= ~mask.any(-1)
    L = mask.shape[-1]
    return mask[:, :, None, :].expand(B, T, group, L).reshape(B, 1, T * group, L)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    meta: AttnMetadata,
    cache: BlockKV | None,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q (B, T, nh, hd), k/v (B, T, nkv, hd) -> (B, T, nh * hd).

    ``mask`` comes from ``build_mask`` and is None exactly when ``uses_kernel`` holds.
    """
    B, T, nh, hd = q.shape
    nkv = k.shape[2]
    g = nh // nkv
    if meta.tap is not None:
        meta.tap.add(q)
    if cache is not None:
        kf, vf = k.reshape(B * T, nkv, hd), v.reshape(B * T, nkv, hd)
        if meta.valid_index is not None:
            kf, vf = kf.index_select(0, meta.valid_index), vf.index_select(0, meta.valid_index)
        if isinstance(cache, QuantBlockKV):
            cache.write_meta(meta, kf, vf)
            if q.dtype == torch.float32 and cache.decode_kernel and g <= MAX_GROUP:
                # the blocks read in place, a prefill's rows each over its own positions; SDPA over a dequantized
                # copy summed in an order that follows the CPU, and a quantized cache turns that into codes
                return cache.attend_decode(q, meta, window, scale)
            keys, values = (t.to(q.dtype) for t in cache.read_meta(meta))  # (B, nkv, L, hd), dequantized
        else:
            cache.write(meta.slot_mapping, kf, vf)
            if mask is None and prefill.applies(T, meta.context_lens, window):
                if cache.k.dtype == torch.float32 and hd % 8 == 0:  # the fixed-order kernel: every CPU's bits
                    return prefill_attention(q, cache.k, cache.v, meta.block_tables, meta.kv_positions,
                                             _query_valid(meta, T), scale)
                return prefill.prefill_attention(q, k, v, meta.kv_positions, meta.new_tokens, meta.block_tables,
                                                 cache.k, cache.v, scale)
            if mask is None and cache.k.dtype == torch.float32:
                return paged_attention(q, cache.k, cache.v, meta.block_tables, meta.kv_positions, meta.query_valid,
                                       window, scale)
            if mask is None and g <= MAX_GROUP:  # an fp16 or bf16 pool
                k_src, v_src = cache.sources()
                return attention_kv(q, meta.block_tables, meta.kv_positions, meta.query_valid, meta.context_lens,
                                    k_src, v_src, window=window, scale=scale)
            keys, values = (t.to(q.dtype) for t in cache.read(meta.block_tables))  # (B, nkv, L, hd)
    else:
        keys, values = k.transpose(1, 2), v.transpose(1, 2)  # (B, nkv, T, hd)
    if mask is None:  # a pool read without a mask on decode, now read whole (a prefill, or a group too wide)
        mask = build_mask(meta, g, window)
    # queries of one KV group side by side: (B, nkv, T * g, hd)
    qg = q.view(B, T, nkv, g, hd).permute(0, 2, 1, 3, 4).reshape(B, nkv, T * g, hd)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    return out.view(B, nkv, T, g, hd).permute(0, 2, 1, 3, 4).reshape(B, T, nh * hd)
