"""The dense linear layer that quantized layers replace.

On the 2-core AVX2 EPYC qbench was first measured on, MKL's small-M GEMM reads a (out, in)
weight at well under half the memory bandwidth. qbench keeps fp32 weights packed in
16-column panels for its own kernel (``qbench.kernels``), which streams them once per
decode step; without that kernel it keeps them input-major, (in, out), for oneDNN,
which is the faster of torch's paths here. ``qbench bench`` measures both.

The same kernel runs every size: from 32 rows it works in blocks (512 values of k by 120 rows, a panel's
block held in L1 across the rows), and on AVX-512 in tiles of 12 rows by 32 columns. On the 2-core Xeon it
matches or beats oneDNN's cache-blocked GEMM at 256 to 1,024 rows (0.97x to 1.8x on SmolLM2's and Qwen's
shapes) and is 1.3x to 2.5x it at 8 to 32 rows. Each output is one fused multiply-add chain over k in order,
whatever the tile, block or instruction set, so a row's result does not depend on the other rows of the
call (eval runs at batch 1, 3 or across processes agree to the bit) nor on the CPU: a prefill gives the same
bits on an AVX2-only EPYC as on an AVX-512 Xeon, where oneDNN's blocking and vector width followed the CPU.
Quantized linears dequantize prefill-sized products into fp32 panels for the same kernel (``qlinear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qbench.kernels import build as kernels
from qbench.kernels.ops import gemm_packed, gemm_panels_into, pack_panels, unpack_panels

_DNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
DENSE_ROWS = 256  # rows per sequence from which quantized linears dequantize (measured: see qlinear)
SLAB_FLOATS = 8 << 20  # a dequantized weight is made this many values (32 MiB) at a time: a 151,936-row head
# is not dequantized whole (545 MB) for one call


def takes_dense(x: torch.Tensor) -> bool:
    """x (..., T, K): T rows per sequence (M for a 2-D x) reach ``DENSE_ROWS``."""
    return x.dim() >= 2 and x.shape[-2] >= DENSE_ROWS


def dense_matmul(x2: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 (M, K) @ weight_t (K, N) + bias on torch's fastest fp32 GEMM here (the path without kernels)."""
    if _DNN and x2.dtype == torch.float32 and x2.is_contiguous():
        return torch.ops.mkldnn._linear_pointwise(x2, weight_t.t(), bias, "none", [], "")
    return F.linear(x2, weight_t.t(), bias)


def dense_by_slabs(x2: torch.Tensor, n: int, slab, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 (M, K) @ W (K, n) + bias on the panel kernel, with W made by ``slab(p0, p1, cols)`` -> fp32 panels
    (p1 - p0, K, 16) for the 16-column panels [p0, p1), at most ``SLAB_FLOATS`` values at a time."""
    x2 = x2.contiguous()
    K = x2.shape[1]
    cols = max(16, SLAB_FLOATS // K // 16 * 16)
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    for n0 in range(0, n, cols):
        c = min(cols, n - n0)
        gemm_panels_into(x2, slab(n0 // 16, -(-(n0 + c) // 16), c), None if bias is None else bias[n0:n0 + c],
                         y[:, n0:], c)
    return y


class Linear(torch.nn.Module):
    """y = x W^T + b for a W given as (out, in); ``weight`` gives that view back."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else torch.nn.Parameter(bias.contiguous(), requires_grad=False)
        if weight.dtype == torch.float32 and kernels.available():
            self.packed = torch.nn.Parameter(pack_panels(weight), requires_grad=False)  # (N/16, K, 16)
            self.weight_t = None
        else:
            self.packed = None
            self.weight_t = torch.nn.Parameter(weight.t().contiguous(), requires_grad=False)  # (K, N)

    @property
    def weight(self) -> torch.Tensor:
        """(out, in); a copy when the weight is packed."""
        if self.packed is not None:
            return unpack_panels(self.packed, self.out_features).t()
        return self.weight_t.t()

    def set_weight(self, weight: torch.Tensor) -> None:
        """Replace W (out, in) in place of the current layout (a quantizer rescaling columns, say)."""
        if self.packed is not None:
            self.packed = torch.nn.Parameter(pack_panels(weight.float()), requires_grad=False)
        else:
            self.weight_t = torch.nn.Parameter(weight.t().contiguous(), requires_grad=False)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of W (out, in) for ``ids`` (N,) -> (N, in): a tied lm_head's token embeddings."""
        if self.packed is not None:
            return self.packed[ids // 16, :, ids % 16]
        return self.weight_t.index_select(1, ids).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return dense_matmul(x, self.weight_t, self.bias)
        return gemm_packed(x, self.packed, self.bias, self.out_features)


def fuse(linears: list[tuple[torch.Tensor, torch.Tensor | None]]) -> Linear:
    """Concatenate several projections that read the same input into one matmul."""
    weight = torch.cat([w for w, _ in linears], dim=0)
    biases = [b for _, b in linears]
    if all(b is None for b in biases):
        return Linear(weight)
    bias = torch.cat([
        b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype) for (w, _), b in zip(linears, biases)
    ])
    return Linear(weight, bias)
