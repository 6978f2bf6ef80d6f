"""Torch-facing wrappers of the native kernels, with the packing they expect."""

from __future__ import annotations

import torch

from qbench.kernels.build import load

PANEL = 16


def pack_panels(weight_t: torch.Tensor) -> torch.Tensor:
    """(K, N) input-major weight -> (ceil(N/16), K, 16) panels, zero-padded on N."""
    K, N = weight_t.shape
    pad = (-N) % PANEL
    if pad:
        weight_t = torch.cat([weight_t, weight_t.new_zeros(K, pad)], dim=1)
    return weight_t.reshape(K, -1, PANEL).permute(1, 0, 2).contiguous()


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
