"""The calibration runs in float64, so that every machine computes the same artifact (issue 21).

AWQ's grid search, its clipping search, GPTQ's Hessian and SmoothQuant's maxima turn the last bits of the
calibration activations into choices. In float32 those bits depend on the code that computed them: qbench's
kernels per instruction set, ATen's vectorised ops, MKL's and oneDNN's paths, even the number of threads
(MKL splits a long X^T X between threads). Two machines then chose different scales for some channel and
wrote different artifacts (a `w4g128-awq` digest differed between an AVX-512 EPYC and a Xeon).

During calibration each block in turn is widened: its linears become ``WideLinear`` (float64 weights, plain
torch matmuls) and its norms hold float64 weights, and the block forward, the captured inputs, the searches,
the folds and the Hessians are all float64. Orders of summation still differ between machines, but now at
about 1e-16 relative instead of 1e-7: a choice changes only where two candidates' losses, or a value and a
rounding boundary, lie within that distance. Once a linear is quantized, its
WideLinear holds the dequantized weights (and puts its inputs on the int8 grid for int8 activations), so the
next block sees the quantized block's output, as before. ``narrow`` then gives the block its float32 and
quantized modules back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qbench.layers.linear import Linear
from qbench.layers.norm import LayerNorm, RMSNorm
from qbench.quant.hadamard import fwht
from qbench.quant.primitives import QTensor, dequantize, fake_quantize_activations
from qbench.quant.qlinear import make_qlinear

WIDE = torch.float64


class WideLinear(torch.nn.Module):
    """y = x W^T + b in float64: a linear of the block being calibrated. ``q`` is set once it is quantized."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.w = weight.to(WIDE)  # (out, in)
        self.bias = None if bias is None else bias.to(WIDE)
        self.q: QTensor | None = None

    @property
    def weight(self) -> torch.Tensor:
        return self.w

    def set_weight(self, weight: torch.Tensor) -> None:
        self.w = weight.to(WIDE)

    def quantized(self, q: QTensor) -> None:
        """From now on compute what the quantized linear computes: its dequantized weights, and its inputs on
        the int8 grid when its activations are int8 (rounded as the kernels round them, from float32), after
        the Hadamard rotation when it has one."""
        self.q = q
        self.w = dequantize(q).to(WIDE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.q is not None and self.q.hadamard:  # its dequantized weights are W H / b: they meet x H
            x = fwht(x, self.q.hadamard)
        if self.q is not None and self.q.activations == "int8":
            x = fake_quantize_activations(x).to(WIDE)
        return F.linear(x, self.w, self.bias)


def _norm_params(mod: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in (mod.weight, getattr(mod, "bias", None)) if p is not None]


def widen(block: torch.nn.Module) -> None:
    """Every fp linear of ``block`` -> a WideLinear, every norm's parameters -> float64, in place."""
    for name, mod in list(block.named_modules()):
        if isinstance(mod, Linear):
            block.set_submodule(name, WideLinear(mod.weight, mod.bias))
        elif isinstance(mod, (RMSNorm, LayerNorm)):
            for p in _norm_params(mod):
                p.data = p.data.to(WIDE)


def narrow(block: torch.nn.Module) -> None:
    """Undo ``widen``: a quantized WideLinear -> its quantized module, another -> a float32 Linear (with any
    scales folded into it), norms -> float32."""
    for name, mod in list(block.named_modules()):
        if isinstance(mod, WideLinear):
            bias = None if mod.bias is None else mod.bias.float()
            block.set_submodule(name, make_qlinear(mod.q, bias) if mod.q is not None else Linear(mod.w.float(), bias))
        elif isinstance(mod, (RMSNorm, LayerNorm)):
            for p in _norm_params(mod):
                p.data = p.data.float()
