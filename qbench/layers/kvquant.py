"""KV-cache quantization math (KIVI semantics), as pure tensor functions, and the codecs that store blocks;
the scheme that picks them is layers/kvscheme.py.

Keys have per-channel outliers and values do not (the seeds, KIVI), so:
- K is quantized per channel: min/max statistics over a group of G tokens, one (scale, min) per
  (kv head, channel) per group;
- V is quantized per token: statistics over groups of ``group`` channels along head_dim.
Both are asymmetric min/max at 8, 4 or 2 bits, with FP16 scale and min. FP8 (e4m3) with a per-token
scale is another scheme. Naive baselines exist so that the asymmetry can be measured, not assumed:
per-tensor INT8/INT4 (one scale and min per block of G tokens, all heads and channels) and per-token K.

Every dequantize function takes any number of leading dimensions, so one call dequantizes a whole
block table: codes (..., G, nkv, hd * bits / 8) with statistics (..., *stat_shape).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (8, 4, 2)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class QKV:
    """Quantized K or V: codes packed along the last dimension, with FP16 scale and min."""

    codes: torch.Tensor  # uint8, last dim = hd * bits / 8
    scale: torch.Tensor  # fp16
    minimum: torch.Tensor | None  # fp16; None for FP8
    bits: int
    shape: tuple[int, ...]


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes in [0, 2^bits) -> packed bytes along the last dim, lowest index in the lowest bits."""
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    per = 8 // bits
    c = codes.to(torch.uint8).view(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = torch.zeros(c.shape[:-1], dtype=torch.uint8)
    for i in range(per):
        out |= c[..., i] << (bits * i)
    return out


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).view(*packed.shape[:-1], packed.shape[-1] * per)


def _minmax_quant(x: torch.Tensor, bits: int, reduce_dims: tuple[int, ...]) -> QKV:
    levels = (1 << bits) - 1
    lo = x.float().amin(dim=reduce_dims, keepdim=True)
    hi = x.float().amax(dim=reduce_dims, keepdim=True)
    scale = ((hi - lo) / levels).clamp(min=1e-8).half()
    lo16 = lo.half()
    codes = torch.clamp(torch.round((x.float() - lo16.float()) / scale.float()), 0, levels)
    return QKV(pack_bits(codes, bits), scale, lo16, bits, tuple(x.shape))


def quantize_k_per_channel(k: torch.Tensor, bits: int) -> QKV:
    """Full groups of keys (..., G, nkv, hd) -> statistics over the G tokens, per (head, channel)."""
    q = _minmax_quant(k, bits, (-3,))
    q.scale, q.minimum = q.scale.squeeze(-3), q.minimum.squeeze(-3)  # (..., nkv, hd)
    return q


def dequantize_k_per_channel(q: QKV) -> torch.Tensor:
    """codes (..., G, nkv, cw), scale/min (..., nkv, hd) -> (..., G, nkv, hd)."""
    return unpack_bits(q.codes, q.bits).float() * q.scale.float().unsqueeze(-3) + q.minimum.float().unsqueeze(-3)


def quantize_v_per_token(v: torch.Tensor, bits: int, group: int) -> QKV:
    """Values (..., T, nkv, hd) -> statistics per token over groups of ``group`` channels."""
    hd = v.shape[-1]
    if hd % group:
        raise ValueError(f"V group {group} does not divide head_dim {hd}")
    q = _minmax_quant(v.reshape(*v.shape[:-1], hd // group, group), bits, (-1,))
    return QKV(q.codes.reshape(*v.shape[:-1], -1), q.scale[..., 0], q.minimum[..., 0], bits, tuple(v.shape))


def dequantize_v_per_token(q: QKV) -> torch.Tensor:
    """codes (..., T, nkv, cw), scale/min (..., T, nkv, hd / group) -> (..., T, nkv, hd)."""
    codes = unpack_bits(q.codes, q.bits).float()
    ng = q.scale.shape[-1]
    c = codes.view(*codes.shape[:-1], ng, codes.shape[-1] // ng)
    return (c * q.scale.float()[..., None] + q.minimum.float()[..., None]).flatten(-2)


def quantize_fp8_per_token(x: torch.Tensor) -> QKV:
    """(..., T, nkv, hd) -> e4m3 codes with one scale per token (absmax / 448), stored as raw bytes."""
    scale = (x.float().abs().amax(dim=(-2, -1), keepdim=True) / FP8_MAX).clamp(min=1e-12).half()
    f8 = (x.float() / scale.float()).to(torch.float8_e4m3fn)
    return QKV(f8.view(torch.uint8), scale[..., 0, 0], None, 8, tuple(x.shape))


def dequantize_fp8_per_token(q: QKV) -> torch.Tensor:
    """codes (..., T, nkv, hd), scale (..., T) -> (..., T, nkv, hd)."""
    return q.codes.view(torch.float8_e4m3fn).float() * q.scale.float()[..., None, None]


def quantize_per_tensor(x: torch.Tensor, bits: int) -> QKV:
    """Naive baseline: one min/max per (G, nkv, hd) block of x (..., G, nkv, hd); scale and min (..., 1)."""
    q = _minmax_quant(x, bits, (-3, -2, -1))
    q.scale, q.minimum = q.scale.reshape(*x.shape[:-3], 1), q.minimum.reshape(*x.shape[:-3], 1)
    return q


def dequantize_per_tensor(q: QKV) -> torch.Tensor:
    """codes (..., *shape), scale/min (..., 1) -> (..., *shape) for a 3-d ``shape``."""
    codes = unpack_bits(q.codes, q.bits).float()
    return codes * q.scale.float()[..., None, None] + q.minimum.float()[..., None, None]


def quantize_k_per_token(k: torch.Tensor, bits: int, group: int) -> QKV:
    """Naive baseline for K: statistics per token over channel groups, as V is done."""
    return quantize_v_per_token(k, bits, group)


@dataclass(frozen=True)
class Codec:
    """How one of K or V is stored in a block of G tokens: the layout of its codes and statistics."""

    mode: str  # none | channel | token | tensor | fp8
    bits: int
    group: int = 0  # channels per statistic, for ``token``

    def code_shape(self, G: int, nkv: int, hd: int) -> tuple[int, ...]:
        return (G, nkv, hd if self.mode == "none" else hd * self.bits // 8)

    def stat_shape(self, G: int, nkv: int, hd: int) -> tuple[int, ...] | None:
        return {"none": None, "channel": (nkv, hd), "token": (G, nkv, hd // max(self.group, 1)),
                "tensor": (1,), "fp8": (G,)}[self.mode]

    @property
    def has_min(self) -> bool:
        return self.mode in ("channel", "token", "tensor")

    def quantize(self, x: torch.Tensor) -> QKV:
        """x (..., G, nkv, hd) -> codes and statistics in the shapes above, with the same leading dims."""
        if self.mode == "channel":
            return quantize_k_per_channel(x, self.bits)
        if self.mode == "token":
            return quantize_v_per_token(x, self.bits, self.group)
        if self.mode == "tensor":
            return quantize_per_tensor(x, self.bits)
        if self.mode == "fp8":
            return quantize_fp8_per_token(x)
        return QKV(x, None, None, 16, tuple(x.shape))

    def dequantize(self, codes: torch.Tensor, scale, minimum) -> torch.Tensor:
        q = QKV(codes, scale, minimum, self.bits, ())
        fn = {"channel": dequantize_k_per_channel, "token": dequantize_v_per_token, "tensor": dequantize_per_tensor,
              "fp8": dequantize_fp8_per_token}.get(self.mode)
        return codes.float() if fn is None else fn(q)

    def block_bytes(self, G: int, nkv: int, hd: int, fp_bytes: int) -> int:
        """Exact bytes one block of G tokens of this tensor occupies (codes plus statistics)."""
        n = 1
        for d in self.code_shape(G, nkv, hd):
            n *= d
        if self.mode == "none":
            return n * fp_bytes
        s = 1
        for d in self.stat_shape(G, nkv, hd):
            s *= d
        return n + 2 * s * (2 if self.has_min else 1)
