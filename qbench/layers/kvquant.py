"""KV-cache quantization math (KIVI semantics), as pure tensor functions.

Keys have per-channel outliers and values do not (the seeds, KIVI), so:
- K is quantized per channel: min/max statistics over a group of G tokens, one (scale, min) per
  (kv head, channel) per group;
- V is quantized per token: statistics over groups of ``group`` channels along head_dim.
Both are asymmetric min/max at 8, 4 or 2 bits, with FP16 scale and min. FP8 (e4m3) with a per-token
scale is another scheme. Naive baselines exist so that the asymmetry can be measured, not assumed:
per-tensor INT8/INT4 and per-token K.

Layout of one group of G tokens of K: codes (G, nkv, hd) packed along hd, scale/min (nkv, hd).
Layout of V for T tokens: codes (T, nkv, hd) packed along hd, scale/min (T, nkv, hd // group).
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
    minimum: torch.Tensor | None  # fp16; None for FP8 and symmetric baselines
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


def _minmax_dequant(q: QKV) -> torch.Tensor:
    return unpack_bits(q.codes, q.bits).float() * q.scale.float() + q.minimum.float()


def quantize_k_per_channel(k: torch.Tensor, bits: int) -> QKV:
    """One full group of keys (G, nkv, hd) -> statistics over the G tokens, per (head, channel)."""
    q = _minmax_quant(k, bits, (0,))
    q.scale, q.minimum = q.scale[0], q.minimum[0]  # (nkv, hd)
    return q


def dequantize_k_per_channel(q: QKV) -> torch.Tensor:
    return unpack_bits(q.codes, q.bits).float() * q.scale.float() + q.minimum.float()


def quantize_v_per_token(v: torch.Tensor, bits: int, group: int) -> QKV:
    """Values (T, nkv, hd) -> statistics per token over groups of ``group`` channels."""
    T, nkv, hd = v.shape
    if hd % group:
        raise ValueError(f"V group {group} does not divide head_dim {hd}")
    q = _minmax_quant(v.view(T, nkv, hd // group, group), bits, (3,))
    return QKV(q.codes.view(T, nkv, -1), q.scale[..., 0], q.minimum[..., 0], bits, (T, nkv, hd))


def dequantize_v_per_token(q: QKV) -> torch.Tensor:
    T, nkv, hd = q.shape
    g = hd // q.scale.shape[-1]
    codes = unpack_bits(q.codes, q.bits).float().view(T, nkv, -1, g)
    return (codes * q.scale.float()[..., None] + q.minimum.float()[..., None]).view(T, nkv, hd)


def quantize_fp8_per_token(x: torch.Tensor) -> QKV:
    """(T, nkv, hd) -> e4m3 codes with one scale per token (absmax / 448), stored as raw bytes."""
    scale = (x.float().abs().amax(dim=(1, 2), keepdim=True) / FP8_MAX).clamp(min=1e-12).half()
    f8 = (x.float() / scale.float()).to(torch.float8_e4m3fn)
    return QKV(f8.view(torch.uint8), scale[:, 0, 0], None, 8, tuple(x.shape))


def dequantize_fp8_per_token(q: QKV) -> torch.Tensor:
    return q.codes.view(torch.float8_e4m3fn).float() * q.scale.float()[:, None, None]


def quantize_per_tensor(x: torch.Tensor, bits: int) -> QKV:
    """Naive baseline: one min/max for the whole tensor."""
    q = _minmax_quant(x, bits, tuple(range(x.dim())))
    q.scale, q.minimum = q.scale.reshape(()), q.minimum.reshape(())
    return q


def dequantize_per_tensor(q: QKV) -> torch.Tensor:
    return unpack_bits(q.codes, q.bits).float() * q.scale.float() + q.minimum.float()


def quantize_k_per_token(k: torch.Tensor, bits: int) -> QKV:
    """Naive baseline for K: statistics per token over all channels of a head, as V is done."""
    return quantize_v_per_token(k, bits, k.shape[-1])


@dataclass(frozen=True)
class KVScheme:
    k_bits: int = 16
    v_bits: int = 16
    group: int = 16  # tokens per K group (default: the block size)
    v_group: int = 32  # channels per V group
    residual: int = 16  # tokens kept in full precision, a multiple of ``group``
    scheme: str = "kivi"  # kivi | fp8 | per-tensor | per-token-k

    def bytes_per_token(self, num_layers: int, nkv: int, hd: int, fp_bytes: int = 4) -> float:
        """Bytes per cached token in steady state (the residual window excluded), all layers."""
        if self.scheme == "fp8":
            per = 2 * (nkv * hd + 2)  # one byte per element, one fp16 scale per token, K and V
            return num_layers * per
        k = nkv * hd * (fp_bytes if self.k_bits == 16 else self.k_bits / 8)
        v = nkv * hd * (fp_bytes if self.v_bits == 16 else self.v_bits / 8)
        if self.scheme == "kivi":
            if self.k_bits != 16:
                k += 4 * nkv * hd / self.group  # fp16 scale + min per channel per group of tokens
            if self.v_bits != 16:
                v += 4 * nkv * hd / self.v_group  # fp16 scale + min per token per channel group
        return num_layers * (k + v)
