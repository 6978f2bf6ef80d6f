"""The dense linear layer that quantized layers replace.

On the 2-core AVX2 EPYC qbench was first measured on, MKL's small-M GEMM reads a (out, in)
weight at well under half the memory bandwidth. qbench keeps fp32 weights packed in
16-column panels for its own kernel (``qbench.kernels``), which streams them once per
decode step; without that kernel it keeps them input-major, (in, out), for oneDNN,
which is the faster of torch's paths here. ``qbench bench`` measures both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qbench.kernels import build as kernels
from qbench.kernels.ops import gemm_packed, pack_panels, unpack_panels

_DNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


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
        if self.packed is not None:
            return gemm_packed(x, self.packed, self.bias, self.out_features)
        if _DNN and x.dtype == torch.float32 and x.is_contiguous():
            return torch.ops.mkldnn._linear_pointwise(x, self.weight_t.t(), self.bias, "none", [], "")
        return F.linear(x, self.weight_t.t(), self.bias)


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
