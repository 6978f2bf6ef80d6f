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
    """x (..., K) float32 @ packed panels -> (..., n)."""
    lib = load()
    K = packed.shape[1]
    x2 = x.reshape(-1, K)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    lib.qb_gemm_f32_packed(x2.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
                           x2.shape[0], K, n, torch.get_num_threads())
    return y.view(*x.shape[:-1], n)


def dequant_i8(panels: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """INT8 panels (P, K, 16) and per-column scales -> the dense weight (K, n) float32."""
    K = panels.shape[1]
    out = torch.empty(K, n, dtype=torch.float32)
    load().qb_dequant_i8(panels.data_ptr(), scale.data_ptr(), out.data_ptr(), K, n, torch.get_num_threads())
    return out


def dequant_i4(panels: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int, n: int,
               group: int) -> torch.Tensor:
    """INT4 panels in ``qb_gemm_i4``'s layout -> the dense weight (k, n) float32."""
    out = torch.empty(k, n, dtype=torch.float32)
    load().qb_dequant_i4(panels.data_ptr(), scales.data_ptr(), zeros.data_ptr(), out.data_ptr(), k, n, group,
                         torch.get_num_threads())
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


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nrot: int) -> None:
    """Rotate heads [0, nrot) of x (B, T, nheads, hd) in place; cos/sin tables (P, hd/2)."""
    B, T, nheads, hd = x.shape
    assert x.is_contiguous() and positions.dtype == torch.int64
    pos = positions.contiguous()
    load().qb_rope(x.data_ptr(), pos.data_ptr(), cos.data_ptr(), sin.data_ptr(), B * T, nheads, nrot, hd,
                   torch.get_num_threads())


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                    positions: torch.Tensor, valid: torch.Tensor | None, window: int | None,
                    scale: float) -> torch.Tensor:
    """q (B, T, nh, hd) against the pool (num_blocks, bs, nkv, hd) -> (B, T, nh * hd)."""
    B, T, nh, hd = q.shape
    _, bs, nkv, _ = k_pool.shape
    q = q.contiguous()
    out = torch.empty(B, T, nh * hd, dtype=torch.float32)
    tables = block_tables.contiguous()
    pos = positions.contiguous()
    v8 = None if valid is None else valid.to(torch.uint8).contiguous()
    load().qb_paged_attention(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), tables.data_ptr(), pos.data_ptr(),
                              0 if v8 is None else v8.data_ptr(), out.data_ptr(), B, T, nh, nkv, hd, bs,
                              tables.shape[1], window or 0, scale, torch.get_num_threads())
    return out
