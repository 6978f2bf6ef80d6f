"""Thin runtime modules that hold integer weights as buffers and only do forward.

Four implementations of the same math, chosen per module at construction:
- ``native``: qbench's C kernels (``qbench/kernels/gemm_q.c``: fp32 activations against INT8, INT4 or FP8;
  ``gemm_a8.c``: per-token INT8 activations against INT4 or INT8, W4A8 / W8A8);
- ``aten``: torch's ``_weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu``, fp32 activations;
- ``aten-bf16``: the same kernels fed bf16 activations (and bf16 scales), where torch says they are fast;
- ``reference``: dequantize-then-matmul, the slow path every fast path is tested against.
``QBENCH_QLINEAR`` forces one; the default is ``native`` when the kernels built, else ``aten``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from qbench.kernels import build as kernels
from qbench.kernels.ops import dequant_f8, dequant_i4, dequant_i8, fwht_
from qbench.layers.linear import dense_by_slabs, takes_dense
from qbench.quant.hadamard import fwht
from qbench.quant.primitives import QTensor, dequantize, fake_quantize_activations, padded_width, \
    scheme_fits

PANEL = 16
# From ``linear.DENSE_ROWS`` rows per sequence on, the native path dequantizes the weight once per call into
# fp32 panels and runs the blocked fp32 panel GEMM (gemm_f32.c, in a fixed order): the integer kernels
# re-read x for every 16-column panel and fall to 40-90 GFLOP/s at prefill sizes, against about 200-300 for
# the blocked GEMM (2-core Xeon, Qwen2.5-0.5B's shapes).
IMPLS = ("native", "aten", "aten-bf16", "reference")


def default_impl() -> str:
    forced = os.environ.get("QBENCH_QLINEAR")
    if forced:
        if forced not in IMPLS:
            raise ValueError(f"QBENCH_QLINEAR={forced!r}; choose one of {', '.join(IMPLS)}")
        return forced
    return "native" if kernels.available() else "aten"


def _pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    pad = n - t.shape[0]
    return t if pad == 0 else torch.cat([t, t.new_zeros(pad, *t.shape[1:])])


class QuantLinear(torch.nn.Module):
    """y = x W^T + b with W stored as a ``QTensor``; subclasses lay it out for their kernels."""

    def __init__(self, q: QTensor, bias: torch.Tensor | None, impl: str | None = None):
        super().__init__()
        self.q = q  # canonical form, kept for the reference path, saving and export
        self.out_features, self.in_features = q.shape
        self.bias = None if bias is None else torch.nn.Parameter(bias.float().contiguous(), requires_grad=False)
        self.impl = impl or default_impl()
        if self.impl == "native" and not kernels.available():
            self.impl = "aten"
        self.bits, self.group_size, self.type = q.bits, q.group_size, q.type
        self.activations = q.activations  # "int8": every path multiplies per-token int8 activations (W4A8, W8A8)
        self.hadamard = q.hadamard  # b > 0: every path first rotates the inputs, x -> x H (quant/hadamard.py)
        if not scheme_fits(q.bits, q.activations, q.type):
            raise ValueError(f"{self.activations} activations with {q.bits}-bit weights are not supported "
                             f"(activations are fp32 or int8; weights INT4 or INT8)")
        self._prepare()
        if self.impl != "reference":
            self.q = None  # the kernel layout is all that runs; the artifact keeps the canonical codes

    @property
    def _act_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.impl == "aten-bf16" else torch.float32

    def _aten_input(self, x2: torch.Tensor) -> torch.Tensor:
        """(M, K) -> (M, k_pad) in the activation dtype torch's kernel is fed; the padded columns meet zero weights."""
        if self.k_pad != self.in_features:
            x2 = F.pad(x2, (0, self.k_pad - self.in_features))
        return x2.to(self._act_dtype)

    def _prepare(self) -> None:
        raise NotImplementedError

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        """The activations as this layer's weights meet them: x, or x on its per-token int8 grid."""
        return fake_quantize_activations(x) if self.activations == "int8" else x

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        if self.hadamard:
            x = fwht(x.float(), self.hadamard)
        return F.linear(self._act(x), dequantize(self.q), self.bias)

    def _rotate(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 (M, K) fp32 -> x2 H, a new tensor (the caller's input is left alone)."""
        if self.impl != "native":
            return fwht(x2, self.hadamard)
        x2 = x2.clone()
        fwht_(x2, self.hadamard)
        return x2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "reference":
            return self.reference(x)
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        if self.hadamard:
            x2 = self._rotate(x2)
        y = self._matmul(x2, takes_dense(x) and not self._integer_prefill())
        bias = self._parameters.get("bias")  # None: no bias (then a plain attribute)
        if bias is not None:
            y += bias
        return y.view(*x.shape[:-1], self.out_features)

    def _integer_prefill(self) -> bool:
        """Whether int8 activations take the integer kernel at prefill sizes too, instead of their fp32 grid
        against the dequantized weight on the fp32 panel GEMM. Its integer dot products do two to eight times the
        multiply-adds per instruction of an fp32 FMA: on AVX2 (2-core EPYC, Qwen2.5-0.5B's shapes at 256 and
        1,024 rows: W8A8 50-83 against 34-56 GMAC/s, W4A8 62-102 against 33-53) and with AVX-512 VNNI's
        vpdpbusd (2-core Xeon, the same shapes: W8A8 291-348, W4A8 322-329 against oneDNN's fp32 145-153). An
        AVX-512 CPU without VBMI runs the AVX2 tiles (98-111 GMAC/s for W8A8 on that Xeon, below its oneDNN, then the dense path;
        not measured on such a CPU), so there the dense path stays.
        (torch's own int8 GEMM, oneDNN with AMX, ran at 166-253 GMAC/s end to end at these sizes: its int32
        output, scaled in torch, costs more passes over memory than the product.)"""
        if self.activations != "int8" or self.impl != "native":
            return False
        lib = kernels.load()
        return lib.qb_isa() < 512 or bool(lib.qb_a8_wide())

    def _kernel_args(self, *names: str) -> list[int]:
        """Addresses of the kernel-layout buffers. Read from ``_buffers`` directly: a decode step makes about
        a hundred of these calls, and ``nn.Module.__getattr__`` costs a microsecond a name."""
        b = self._buffers
        return [b[n].data_ptr() for n in names]


class Int8Linear(QuantLinear):
    def _prepare(self):
        N, K = self.q.shape
        if self.impl == "native":
            P = -(-N // PANEL)
            codes = _pad_rows(self.q.codes, P * PANEL).view(P, PANEL, K)
            self.register_buffer("panels", codes.transpose(1, 2).contiguous())  # (P, K, 16) int8
            self.register_buffer("scale32", _pad_rows(self.q.scale.float(), P * PANEL).contiguous())
        elif self.impl.startswith("aten"):
            # torch 2.13's bf16 path reads past the row when K % 16 != 0 (garbage or NaN); zero columns
            # that meet zero activations keep both paths exact
            self.k_pad = -(-K // 16) * 16
            self.register_buffer("codes_nk", F.pad(self.q.codes, (0, self.k_pad - K)).contiguous())
            self.register_buffer("scale32", self.q.scale.to(self._act_dtype).contiguous())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows of W (out, in) for ``ids`` (n,) -> (n, in): a tied INT8 head's token embeddings (only
        INT8 per channel is also a per-row table, so only this class has rows)."""
        if self.impl == "native":
            codes, scale = self.panels[ids // PANEL, :, ids % PANEL], self.scale32[ids]  # (n, K)
        elif self.impl == "reference":
            codes, scale = self.q.codes[ids], self.q.scale[ids]
        else:
            codes, scale = self.codes_nk[ids, : self.in_features], self.scale32[ids]
        return codes.float() * scale.float()[:, None]

    _dequant = staticmethod(dequant_i8)  # the panels -> fp32 panels, for prefill

    def _gemm(self, lib):
        return lib.qb_gemm_i8a8 if self.activations == "int8" else lib.qb_gemm_i8

    def _matmul(self, x2: torch.Tensor, dense: bool) -> torch.Tensor:
        if self.impl.startswith("aten"):
            return torch.ops.aten._weight_int8pack_mm(self._aten_input(self._act(x2)), self.codes_nk,
                                                      self.scale32).float()
        if dense:  # prefill: with int8 activations, their grid in fp32 against the dequantized weight
            return dense_by_slabs(self._act(x2), self.out_features, lambda p0, p1, c: self._dequant(
                self.panels[p0:p1], self.scale32[p0 * PANEL:], c, True), None)
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        self._gemm(kernels.load())(x2.data_ptr(), *self._kernel_args("panels", "scale32"), y.data_ptr(),
                                   x2.shape[0], self.in_features, self.out_features, torch.get_num_threads())
        return y


class Fp8Linear(Int8Linear):
    """FP8 e4m3 weights per output channel with fp32 activations (W8A16). The INT8 panels hold the code bytes
    and qb_gemm_f8 / qb_dequant_f8 widen them as FP8. torch has no CPU kernel for FP8 weights against fp32
    activations, so where ``aten`` is asked (or the kernels did not build) this runs the reference path."""

    def __init__(self, q: QTensor, bias: torch.Tensor | None, impl: str | None = None):
        impl = impl or default_impl()
        super().__init__(q, bias, "reference" if impl.startswith("aten") else impl)

    _dequant = staticmethod(dequant_f8)

    def _gemm(self, lib):
        return lib.qb_gemm_f8

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("an FP8 head is never shared with the embedding table")


class Int4Linear(QuantLinear):
    def _prepare(self):
        q = self.q
        N, K = q.shape
        G = q.group_size
        ngroups = q.scale.shape[1]
        zero = q.zero if q.zero is not None else torch.full_like(q.scale, 8, dtype=torch.uint8)
        if self.impl == "native":
            P, K4 = -(-N // PANEL), -(-K // 4) * 4
            codes = _pad_rows(q.codes[:, :K], P * PANEL).view(P, PANEL, K).transpose(1, 2)  # (P, K, 16)
            if K4 != K:  # the kernel reads k four at a time; the extra rows meet zero activations
                codes = torch.cat([codes, codes.new_zeros(P, K4 - K, PANEL)], dim=1)
            nib = codes[..., :8] | (codes[..., 8:] << 4)  # (P, K4, 8): column c low, column c + 8 high
            # pairs of k side by side per column, as _mm256_madd_epi16 consumes them
            packed = nib.view(P, K4 // 2, 2, 8).transpose(2, 3).reshape(P, K4 // 2, 16)
            self.register_buffer("panels", packed.contiguous())  # (P, K4 / 2, 16) uint8
            sc = _pad_rows(q.scale, P * PANEL).view(P, PANEL, ngroups).transpose(1, 2)
            self.register_buffer("scales16", sc.contiguous().view(torch.int16))  # (P, ngroups, 16) fp16 bits
            zp = _pad_rows(zero, P * PANEL).view(P, PANEL, ngroups).transpose(1, 2)
            self.register_buffer("zeros8", zp.contiguous())  # (P, ngroups, 16)
        elif self.impl.startswith("aten"):
            # aten's int4 kernel computes (u - 8) * scale + offset per group: offset = (8 - z) * scale
            self.k_pad = padded_width(K, G)
            n16 = -(-N // PANEL) * PANEL  # the aten kernel needs N % 16 == 0
            self.register_buffer("aten_packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                _pad_rows(q.codes.to(torch.int32), n16).contiguous(), 2))
            s = _pad_rows(q.scale.float(), n16)
            offset = (8.0 - _pad_rows(zero, n16).float()) * s
            sz = torch.stack([s.t(), offset.t()], -1).to(self._act_dtype)
            self.register_buffer("aten_sz", sz.contiguous())  # (ngroups, N, 2)

    def _matmul(self, x2: torch.Tensor, dense: bool) -> torch.Tensor:
        if self.impl.startswith("aten"):
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(self._aten_input(self._act(x2)), self.aten_packed,
                                                           self.group_size, self.aten_sz).float()
            return y[:, : self.out_features].contiguous() if y.shape[1] != self.out_features else y
        if dense:  # prefill: the int8 grid in fp32 against the dequantized weight, the kernel's numbers
            return dense_by_slabs(self._act(x2), self.out_features, lambda p0, p1, c: dequant_i4(
                self.panels[p0:p1], self.scales16[p0:p1], self.zeros8[p0:p1], self.in_features, c,
                self.group_size, True), None)
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        lib = kernels.load()
        gemm = lib.qb_gemm_i4a8 if self.activations == "int8" else lib.qb_gemm_i4
        gemm(x2.data_ptr(), *self._kernel_args("panels", "scales16", "zeros8"), y.data_ptr(), x2.shape[0],
             self.in_features, self.out_features, self.group_size, torch.get_num_threads())
        return y


def make_qlinear(q: QTensor, bias: torch.Tensor | None, impl: str | None = None) -> QuantLinear:
    if q.type == "float":
        return Fp8Linear(q, bias, impl)
    return (Int8Linear if q.bits == 8 else Int4Linear)(q, bias, impl)
