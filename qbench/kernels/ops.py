"""Torch-facing wrappers of the native kernels, with the packing they expect."""

from __future__ import annotations

import torch

from qbench.kernels.build import load

PANEL = 16


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) weight, as nn.Linear stores it -> (ceil(N/16), K, 16) panels, zero-padded on N.

    One copy: loading a large lm_head must not hold several transposed copies at once.
    """
    N, K = weight.shape
    pad = (-N) % PANEL
    if pad:
        weight = torch.cat([weight, weight.new_zeros(pad, K)], dim=0)
    return weight.view(-1, PANEL, K).transpose(1, 2).contiguous()


def unpack_panels(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``pack_panels`` -> (K, N)."""
    P, K, _ = packed.shape
    return packed.permute(1, 0, 2).reshape(K, P * PANEL)[:, :n]


def gemm_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x (..., K) float32 @ packed panels -> (..., n): every output one FMA chain over k in order, then + bias,
    so the same bits for any batch, tile or instruction set (``gemm_f32.c``)."""
    K = packed.shape[1]
    x2 = x.reshape(-1, K)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    gemm_panels_into(x2, packed, bias, y, n)
    return y.view(*x.shape[:-1], n)


def gemm_panels_into(x2: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
                     n: int) -> None:
    """x2 (M, K) contiguous float32 @ packed panels (P, K, 16) + bias -> y (M, >= n) columns [0, n), y's rows
    any distance apart (a slab of a wider output)."""
    assert x2.dtype == packed.dtype == y.dtype == torch.float32, "the panel GEMM is float32"
    assert x2.is_contiguous() and packed.is_contiguous() and y.stride(1) == 1 and y.shape[1] >= n
    load().qb_gemm_f32_panels(x2.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
                              y.data_ptr(), x2.shape[0], packed.shape[1], n, y.stride(0), torch.get_num_threads())


def _dequant_out(k: int, n: int, panels: bool) -> torch.Tensor:
    return torch.empty(-(-n // PANEL), k, PANEL, dtype=torch.float32) if panels else \
        torch.empty(k, n, dtype=torch.float32)


def dequant_i8(panels: torch.Tensor, scale: torch.Tensor, n: int, as_panels: bool = False) -> torch.Tensor:
    """INT8 panels (P, K, 16) and per-column scales -> the dense weight (K, n) float32, or fp32 panels
    (ceil(n/16), K, 16) with ``as_panels``."""
    K = panels.shape[1]
    out = _dequant_out(K, n, as_panels)
    load().qb_dequant_i8(panels.data_ptr(), scale.data_ptr(), out.data_ptr(), K, n, int(as_panels),
                         torch.get_num_threads())
    return out


def dequant_f8(panels: torch.Tensor, scale: torch.Tensor, n: int, as_panels: bool = False) -> torch.Tensor:
    """FP8 e4m3 bytes in the INT8 panels and per-column scales -> the dense weight (K, n) float32 (or panels)."""
    K = panels.shape[1]
    out = _dequant_out(K, n, as_panels)
    load().qb_dequant_f8(panels.data_ptr(), scale.data_ptr(), out.data_ptr(), K, n, int(as_panels),
                         torch.get_num_threads())
    return out


def dequant_i4(panels: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int, n: int,
               group: int, as_panels: bool = False) -> torch.Tensor:
    """INT4 panels in ``qb_gemm_i4``'s layout -> the dense weight (k, n) float32 (or fp32 panels)."""
    out = _dequant_out(k, n, as_panels)
    load().qb_dequant_i4(panels.data_ptr(), scales.data_ptr(), zeros.data_ptr(), out.data_ptr(), k, n, group,
                         int(as_panels), torch.get_num_threads())
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    x = x.contiguous()
    y = torch.empty_like(x)
    load().qb_rmsnorm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps,
                      torch.get_num_threads())
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2n) = [gate | up] -> silu(gate) * up (..., n)."""
    n = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    y = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype)
    load().qb_silu_mul(gate_up.data_ptr(), y.data_ptr(), gate_up.numel() // (2 * n), n, torch.get_num_threads())
    return y


def fwht_(x: torch.Tensor, block: int) -> None:
    """x (..., K) contiguous fp32, in place -> x H (``qbench.quant.hadamard.fwht``'s bits)."""
    assert x.is_contiguous() and x.dtype == torch.float32
    K = x.shape[-1]
    load().qb_fwht(x.data_ptr(), x.numel() // K, K, block, torch.get_num_threads())


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nrot: int) -> None:
    """Rotate heads [0, nrot) of x (B, T, nheads, hd) in place; cos/sin tables (P, hd/2)."""
    B, T, nheads, hd = x.shape
    assert x.is_contiguous() and positions.dtype == torch.int64
    pos = positions.contiguous()
    load().qb_rope(x.data_ptr(), pos.data_ptr(), cos.data_ptr(), sin.data_ptr(), B * T, nheads, nrot, hd,
                   torch.get_num_threads())


def _pool_call(fn, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
               positions: torch.Tensor, valid: torch.Tensor | None, *tail) -> torch.Tensor:
    """fn(q, kpool, vpool, tables, qpos, qvalid, out, B, T, nh, nkv, hd, bs, nblk, *tail, threads) over a float32
    pool (num_blocks, bs, nkv, hd) -> out (B, T, nh * hd): the paged kernels' common call."""
    B, T, nh, hd = q.shape
    _, bs, nkv, _ = k_pool.shape
    q = q.contiguous()
    out = torch.empty(B, T, nh * hd, dtype=torch.float32)
    tables = block_tables.contiguous()
    pos = positions.contiguous()
    v8 = None if valid is None else valid.to(torch.uint8).contiguous()
    fn(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), tables.data_ptr(), pos.data_ptr(),
       0 if v8 is None else v8.data_ptr(), out.data_ptr(), B, T, nh, nkv, hd, bs, tables.shape[1], *tail,
       torch.get_num_threads())
    return out


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                    positions: torch.Tensor, valid: torch.Tensor | None, window: int | None,
                    scale: float) -> torch.Tensor:
    """q (B, T, nh, hd) against the pool (num_blocks, bs, nkv, hd) -> (B, T, nh * hd)."""
    return _pool_call(load().qb_paged_attention, q, k_pool, v_pool, block_tables, positions, valid, window or 0,
                      scale)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """(..., n) float32 -> log-probs over the last axis, in ``qb_log_softmax``'s fixed order."""
    n = x.shape[-1]
    x = x.contiguous()
    y = torch.empty_like(x)
    load().qb_log_softmax(x.data_ptr(), y.data_ptr(), x.numel() // n, n, torch.get_num_threads())
    return y


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                      positions: torch.Tensor, valid: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q (B, T, nh, hd) causally against the fp32 pool (num_blocks, bs, nkv, hd), every key up to each query's
    position already written -> (B, T, nh * hd), in ``attn_prefill.c``'s fixed order (the same bits on every
    CPU); hd a multiple of 8."""
    return _pool_call(load().qb_prefill_attention, q, k_pool, v_pool, block_tables, positions, valid, scale)


MAX_GROUP = 64  # query heads per KV head that qb_attention_kv takes
# qb_attention_kv's row formats
KV_F32, KV_CHANNEL, KV_TOKEN, KV_FP8, KV_F16, KV_BF16 = range(6)
_FP_MODES = {torch.float32: KV_F32, torch.float16: KV_F16, torch.bfloat16: KV_BF16}


def kv_source(mode: int, bits: int = 16, codes: torch.Tensor | None = None, scale: torch.Tensor | None = None,
              minimum: torch.Tensor | None = None, v_group: int = 0) -> tuple:
    """How qb_attention_kv reads K or V: a row format and its pool tensors (codes, fp16 scale and min), which it
    reads by pointer, so they must be contiguous (a pool's tensors are, for its whole life)."""
    if not all(t is None or t.is_contiguous() for t in (codes, scale, minimum)):
        raise ValueError("kv_source: the pool tensors must be contiguous")
    return mode, bits, v_group, codes, scale, minimum


def fp_mode(dtype: torch.dtype) -> int | None:
    return _FP_MODES.get(dtype)


def kv_kernel_fits(head_dim: int, sources: tuple = ()) -> bool:
    """Layouts qb_attention_kv takes: head_dim a multiple of one unpacked chunk (8 codes of 8 bits, 16 of 4,
    32 of 2) and at most 256; V groups made of whole chunks. (The query heads per KV head: ``MAX_GROUP``.)"""
    if head_dim > 256 or head_dim % 8:
        return False
    for mode, bits, v_group, *_ in sources:
        chunk = 8 * (8 // bits) if mode in (KV_CHANNEL, KV_TOKEN) else 8
        if head_dim % chunk or (mode == KV_TOKEN and (v_group % chunk or head_dim % v_group)):
            return False
    return True


def attention_kv(q: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None,
                 context_lens: torch.Tensor, k_src: tuple, v_src: tuple, ring_k: torch.Tensor | None = None,
                 ring_v: torch.Tensor | None = None, slots: torch.Tensor | None = None, window: int | None = None,
                 scale: float = 1.0) -> torch.Tensor:
    """q (B, T, nh, hd) against a pool of any row format (``kv_source``), with a quantized cache's fp32
    residual rings (seqs, W, bs, nkv, hd) -> (B, T, nh * hd). Without rings every block is read from the pool."""
    B, T, nh, hd = q.shape
    codes = k_src[3]
    bs, nkv = codes.shape[1], codes.shape[2]
    q = q.contiguous()
    out = torch.empty(B, T, nh * hd, dtype=torch.float32)
    tables = block_tables.contiguous()
    pos = positions.contiguous()
    ctx = context_lens.to(torch.int64).contiguous()
    v8 = None if valid is None else valid.to(torch.uint8).contiguous()
    W = 0 if ring_k is None else ring_k.shape[1]
    sl = None if slots is None else slots.to(torch.int64).contiguous()

    def ptr(t):
        return 0 if t is None else t.data_ptr()

    load().qb_attention_kv(q.data_ptr(), out.data_ptr(), B, T, nh, nkv, hd, bs, tables.shape[1], tables.data_ptr(),
                           pos.data_ptr(), ptr(v8), ctx.data_ptr(), ptr(sl), W, ptr(ring_k), ptr(ring_v), window or 0,
                           scale, k_src[0], k_src[1], ptr(k_src[3]), ptr(k_src[4]), ptr(k_src[5]),
                           v_src[0], v_src[1], v_src[2], ptr(v_src[3]), ptr(v_src[4]), ptr(v_src[5]),
                           torch.get_num_threads())
    return out


def kv_store(x: torch.Tensor, rows: torch.Tensor | None, blocks: torch.Tensor, mode: int, bits: int, group: int,
             codes: torch.Tensor, scale: torch.Tensor | None, minimum: torch.Tensor | None) -> None:
    """Blocks x (m, bs, nkv, hd) fp32 (block i is x[rows[i]], or x[i] without rows) into pool blocks ``blocks``
    of a store read in ``mode`` (``kv_source``'s first fields and tensors): KIVI codes with fp16 scale and min
    (KV_CHANNEL for keys, KV_TOKEN for values), or a copy into an fp32/fp16/bf16 pool. The codecs' quantize
    (layers/kvquant.py), bit for bit."""
    m, bs, nkv, hd = x.shape
    n = blocks.numel()
    quantized = mode in (KV_CHANNEL, KV_TOKEN)
    if (mode not in (KV_CHANNEL, KV_TOKEN, KV_F32, KV_F16, KV_BF16) or hd > 256 or x.dtype != torch.float32
            or quantized and (bits not in (2, 4, 8) or hd % (8 // bits))
            or mode == KV_TOKEN and (group <= 0 or hd % group)):
        raise ValueError(f"kv_store: mode {mode}, {bits} bits, V group {group}, head_dim {hd}, {x.dtype} not taken")
    if n != (m if rows is None else rows.numel()):
        raise ValueError(f"kv_store: {n} blocks for {m if rows is None else rows.numel()} sources")
    if not all(t is None or t.is_contiguous() for t in (codes, scale, minimum)):
        raise ValueError("kv_store: the pool tensors must be contiguous")
    x = x.contiguous()
    blocks = blocks.to(torch.int64).contiguous()
    rows = None if rows is None else rows.to(torch.int64).contiguous()

    def ptr(t):
        return 0 if t is None else t.data_ptr()

    load().qb_kv_store(x.data_ptr(), ptr(rows), n, bs, nkv, hd, mode, bits, group, blocks.data_ptr(), codes.data_ptr(),
                       ptr(scale), ptr(minimum), torch.get_num_threads())
