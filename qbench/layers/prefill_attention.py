"""Prefill attention on torch's blocked (flash) CPU kernel, for fp16 and bf16 pools.

An fp32 pool's prefill takes the native fixed-order kernel (``kernels/attn_prefill.c``, the same bits on every
CPU); this path serves the pools it does not read (fp16, bf16) and head sizes that are not a multiple of 8.
The paged kernel (``kernels/ops_f32.c``) takes one key at a time: right for decode, where each query reads its
context once, and about 5x slower than a blocked kernel on a 4k-token prefill. A prefill row attends causally
over its own new keys and, when the start of its prompt is already in the cache (a prefix-cache hit, or the
chunks before this one), fully over that cached prefix. The two parts run as separate flash calls and are
merged through their log-sum-exps: exact up to float rounding.
"""

from __future__ import annotations

import torch

# (B, H, T, hd) query/key/value -> (output, logsumexp (B, H, T)); torch's public SDPA drops the logsumexp
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def applies(T: int, context_lens: torch.Tensor, window: int | None) -> bool:
    """A prefill pass (more than one token per row) whose rows all fit inside the sliding window, if any."""
    return T > 1 and (window is None or bool((context_lens <= window).all()))


def _grouped(t: torch.Tensor, nkv: int, g: int) -> torch.Tensor:
    """(n, nh, hd) queries -> (1, nkv, n * g, hd): the g heads that share a KV head side by side."""
    n, _, hd = t.shape
    return t.view(n, nkv, g, hd).permute(1, 0, 2, 3).reshape(1, nkv, n * g, hd)


def _ungrouped(t: torch.Tensor, n: int, g: int) -> torch.Tensor:
    """(1, nkv, n * g, ...) -> (1, nh, n, ...), inverting ``_grouped`` (a logsumexp has no last axis)."""
    nkv = t.shape[1]
    rest = t.shape[3:]
    return t.view(nkv, n, g, *rest).transpose(1, 2).reshape(1, nkv * g, n, *rest)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      new_tokens: torch.Tensor | None, block_tables: torch.Tensor, pool_k: torch.Tensor,
                      pool_v: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, T, nh, hd), this step's k/v (B, T, nkv, hd), each row's first position (its cached prefix
    length) and real token count; the pool (num_blocks, bs, nkv, hd) holds the prefixes
    -> (B, T, nh * hd), zeros on padded query rows."""
    B, T, nh, hd = q.shape
    nkv, bs = k.shape[2], pool_k.shape[1]
    g = nh // nkv
    out = q.new_zeros(B, T, nh * hd)
    for b in range(B):
        n = T if new_tokens is None else int(new_tokens[b])
        P = int(positions[b, 0])
        # strided views, no copies: torch's CPU flash kernel reads any strides and takes grouped-query K/V
        # (nkv heads) itself, with the same bits as K/V repeated per query head
        qb = q[b, :n].transpose(0, 1).unsqueeze(0)  # (1, nh, n, hd)
        kb, vb = (t[b, :n].transpose(0, 1).unsqueeze(0) for t in (k, v))  # (1, nkv, n, hd)
        o, lse = _FLASH(qb, kb, vb, 0.0, True, scale=scale)
        if P:
            nblk = -(-P // bs)
            blocks = block_tables[b, :nblk]
            pk, pv = (pool[blocks].reshape(nblk * bs, nkv, hd)[:P].transpose(0, 1).unsqueeze(0).to(q.dtype)
                      .contiguous() for pool in (pool_k, pool_v))  # (1, nkv, P, hd), an fp16/bf16 pool widened
            o2, lse2 = _FLASH(_grouped(q[b, :n], nkv, g), pk, pv, 0.0, False, scale=scale)
            o2, lse2 = _ungrouped(o2, n, g), _ungrouped(lse2.unsqueeze(-1), n, g).squeeze(-1)
            m = torch.maximum(lse, lse2)
            w1, w2 = torch.exp(lse - m).unsqueeze(-1), torch.exp(lse2 - m).unsqueeze(-1)
            o = (o * w1 + o2 * w2) / (w1 + w2)
        out[b, :n] = o[0].transpose(0, 1).reshape(n, nh * hd)
    return out
