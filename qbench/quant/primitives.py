"""Pure tensor functions for the quantization math. No modules, no I/O.

Conventions (the seeds):
- INT8: symmetric per output channel, scale = absmax / 127, codes in [-127, 127].
- FP8 (``type: float``, W8A16): e4m3 (OCP "fn": no infinities, max 448) per output channel, scale = absmax / 448,
  codes rounded to nearest even by torch's cast and stored as their bytes.
- INT4: groups of G along the input dimension (G in 32, 64, 128). Symmetric: scale = absmax / 7,
  codes clipped to [-8, 7]. Asymmetric: min/max with an integer zero point, codes in [0, 15].
- Scales are FP16. An input width that is not a multiple of G pads the last group with zeros.
- Activations (a recipe's ``activations``): ``fp32``, or ``int8`` per token, dynamic and symmetric
  (scale = absmax / 127, round to nearest even), with INT4 (W4A8) or INT8 (W8A8) weights.
- Canonical INT4 packing: two nibbles per byte along the input dimension, even index in the
  low nibble, stored as unsigned codes (symmetric codes offset by 8, as compressed-tensors does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZES = (32, 64, 128)


@dataclass
class QTensor:
    """A quantized 2-D weight (N, K) with everything needed to dequantize it."""

    bits: int  # 8 or 4
    codes: torch.Tensor  # int8 (N, K) for INT8; uint8 (N, K_pad) unsigned codes for INT4
    scale: torch.Tensor  # fp16 (N,) for INT8; (N, ngroups) for INT4
    zero: torch.Tensor | None  # uint8 (N, ngroups) for asymmetric INT4, else None
    group_size: int | None  # None for per-channel INT8
    shape: tuple[int, int]  # (N, K) before padding
    activations: str = "fp32"  # or "int8": the inputs are quantized per token before they meet the codes
    type: str = "int"  # or "float": 8-bit codes are FP8 e4m3 bytes (uint8), not integers
    hadamard: int = 0  # b > 0: the codes are of W H / b and the inputs meet them as x H (hadamard.py)

    @property
    def symmetric(self) -> bool:
        return self.zero is None


FP8_MAX = 448.0  # the largest finite e4m3fn value
TYPES = ("int", "float")


def padded_width(k: int, group: int) -> int:
    return -(-k // group) * group


def quantize_int8(w: torch.Tensor) -> QTensor:
    """Symmetric per-output-channel INT8."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8).half()
    codes = torch.clamp(torch.round(w / scale.float()[:, None]), -127, 127).to(torch.int8)
    return QTensor(8, codes, scale, None, None, tuple(w.shape))


def quantize_fp8(w: torch.Tensor) -> QTensor:
    """FP8 e4m3 per output channel: scale = absmax / 448 (fp16), codes = w / scale cast to e4m3 (round to
    nearest even; the fp16 scale's rounding can carry a value past 448, which the clamp keeps finite)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-7).half()
    codes = (w / scale.float()[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return QTensor(8, codes, scale, None, None, tuple(w.shape), type="float")


def fp8_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 bytes of e4m3 codes -> their values in fp32."""
    return codes.view(torch.float8_e4m3fn).float()


def int4_params(w: torch.Tensor, group: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales (N, ngroups) fp16 and zero points (N, ngroups) uint8 (None if symmetric) for w (N, K)."""
    N, K = w.shape
    wp = torch.nn.functional.pad(w.float(), (0, padded_width(K, group) - K)).view(N, -1, group)
    if symmetric:
        return (wp.abs().amax(-1) / 7.0).clamp(min=1e-8).half(), None
    lo, hi = wp.amin(-1).clamp(max=0), wp.amax(-1).clamp(min=0)  # the grid always contains 0
    scale = ((hi - lo) / 15.0).clamp(min=1e-8).half()
    zero = torch.clamp(torch.round(-lo / scale.float()), 0, 15).to(torch.uint8)
    return scale, zero


def _int4_levels(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int) -> torch.Tensor:
    """Unsigned codes (N, ngroups, group) in [0, 15], still float, for w under given group parameters. A group of
    zeros whose scale is 0 gets 0/0 = NaN codes."""
    N, K = w.shape
    wp = torch.nn.functional.pad(w.float(), (0, padded_width(K, group) - K)).view(N, -1, group)
    s = scale.float()[..., None]
    if zero is None:
        return torch.clamp(torch.round(wp / s), -8, 7) + 8
    return torch.clamp(torch.round(wp / s) + zero.float()[..., None], 0, 15)


def _int4_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, K: int) -> torch.Tensor:
    """Float codes (N, ngroups, group) -> their values (N, K): (code - zero) * scale, zero 8 when symmetric."""
    z = 8.0 if zero is None else zero.float()[..., None]
    return ((codes - z) * scale.float()[..., None]).view(codes.shape[0], -1)[:, :K]


def quantize_int4_with(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int) -> torch.Tensor:
    """Codes (N, K_pad) uint8 in [0, 15] for w under given group parameters."""
    return _int4_levels(w, scale, zero, group).view(w.shape[0], -1).to(torch.uint8)


def _check_group(group: int) -> None:
    if group not in GROUP_SIZES:
        raise ValueError(f"group size {group} is not supported (supported: {', '.join(map(str, GROUP_SIZES))})")


def quantize_int4(w: torch.Tensor, group: int, symmetric: bool = True) -> QTensor:
    _check_group(group)
    scale, zero = int4_params(w, group, symmetric)
    return QTensor(4, quantize_int4_with(w, scale, zero, group), scale, zero, group, tuple(w.shape))


def dequantize(q: QTensor) -> torch.Tensor:
    """The reference path: codes back to float32 (N, K), one scale per group applied per element."""
    N, K = q.shape
    if q.type == "float":
        return fp8_values(q.codes) * q.scale.float()[:, None]
    if q.bits == 8:
        return q.codes.float() * q.scale.float()[:, None]
    return _int4_values(q.codes.float().view(N, -1, q.group_size), q.scale, q.zero, K)


ACTIVATIONS = ("fp32", "int8")


def scheme_fits(bits: int, activations: str, type: str = "int") -> bool:
    """Whether qbench runs this weight scheme: integer INT4 / INT8 weights with fp32 or int8 activations (W4A8,
    W8A8), or FP8 weights (8 bits) with fp32 activations."""
    if type == "float":
        return bits == 8 and activations == "fp32"
    return type == "int" and activations in ACTIVATIONS and bits in (4, 8)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) -> int8 codes (..., K) and fp32 scales (..., 1): per token (row), symmetric, dynamic.

    The native W4A8 and W8A8 kernels (qbench/kernels/gemm_a8.c) compute the same fp32 scale and reciprocal,
    so their codes are these, bit for bit."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    codes = torch.round(x * (1.0 / scale)).clamp(-127, 127)
    return codes.to(torch.int8), scale


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What a W4A8 or W8A8 linear multiplies its weights by: x rounded to its int8 grid, in fp32."""
    codes, scale = quantize_activations(x)
    return codes.float() * scale


def fake_quantize(w: torch.Tensor, bits: int, group: int | None, symmetric: bool) -> torch.Tensor:
    """Quantize then dequantize: what a search (AWQ's grid) compares against. For INT4 the codes stay in float
    (no uint8 round trip, for a search that calls this 20 times per mapping): the values of
    ``dequantize(quantize_int4(w, ...))``, since every step on the codes is exact in float32."""
    if bits == 8:
        return dequantize(quantize_int8(w))
    _check_group(group)
    scale, zero = int4_params(w, group, symmetric)
    # a group of zeros has scale 0 and NaN codes; the stored path casts those to code 0 (on x86), as here
    codes = _int4_levels(w, scale, zero, group).nan_to_num(0.0)
    return _int4_values(codes, scale, zero, w.shape[1])


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) uint8 codes in [0, 15] -> (N, K/2) bytes, even index in the low nibble."""
    if codes.shape[1] % 2:
        raise ValueError("pack_int4 needs an even number of columns")
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out


def storage_bytes(q: QTensor) -> int:
    """Exact bytes this weight occupies as stored: codes (packed for INT4), fp16 scales, uint8 zeros."""
    code_bytes = q.codes.numel() if q.bits == 8 else q.codes.numel() // 2
    return code_bytes + 2 * q.scale.numel() + (0 if q.zero is None else q.zero.numel())


def bytes_per_weight(bits: int, group: int | None, symmetric: bool) -> float:
    """Nominal bytes per weight for a scheme, e.g. INT4 g128 with FP16 scales: 0.5 + 2/128 = 0.515625."""
    if bits == 8:
        return 1.0  # plus one fp16 scale per output channel, negligible per weight
    return 0.5 + 2 / group + (0 if symmetric else 1 / group)
