"""Rotary position embeddings with integer positions and float32 tables.

Positions stay integers until they index a table of cos/sin built once in float32
(the seeds: BF16 positions near 100,000 round by up to 256). Because every position
reads the same precomputed row, rotating a sequence in chunks, token by token or all
at once gives bit-identical results.
"""

from __future__ import annotations

import math

import torch

from qbench.kernels import build as kernels
from qbench.kernels.ops import rope_


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) in float32, with Llama-3 or linear scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"rope_type {kind!r}")


class RopeTable:
    """cos/sin for positions [0, max_positions), built once in float32."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        pos = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        angles = torch.outer(pos, inv_freq)  # (P, hd/2)
        self.cos = angles.cos()
        self.sin = angles.sin()
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) int64 -> cos, sin (B, T, 1, hd/2) in ``dtype``."""
        if positions.dtype not in (torch.int32, torch.int64):
            raise TypeError("RoPE positions must be integers")
        cos = self.cos[positions].unsqueeze(2)
        sin = self.sin[positions].unsqueeze(2)
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, n, hd) in the Hugging Face half-split layout."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotate_heads(x: torch.Tensor, nrot: int, positions: torch.Tensor, table: RopeTable) -> torch.Tensor:
    """Rotate heads [0, nrot) of x (B, T, nheads, hd) -> (B, T, nrot, hd).

    The native kernel rotates in place inside x (q and k of a fused qkv buffer); the torch
    path returns a new tensor. Both read the same float32 table.
    """
    if x.dtype == torch.float32 and x.is_contiguous() and kernels.available():
        rope_(x, positions, table.cos, table.sin, nrot)
        return x[:, :, :nrot]
    cos, sin = table.lookup(positions, x.dtype)
    return apply_rope(x[:, :, :nrot], cos, sin)
