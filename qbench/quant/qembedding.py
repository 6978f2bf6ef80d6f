"""An INT8 token embedding table: symmetric per row (one fp16 scale per token), dequantized on lookup.

A row of the table is an output channel of a tied lm_head, so an INT8 head and an INT8 embedding of a
tied model are one stored tensor (see ``QuantLinear.rows``).
"""

from __future__ import annotations

import torch

from qbench.quant.primitives import QTensor


class Int8Embedding(torch.nn.Module):
    def __init__(self, q: QTensor, out_dtype: torch.dtype = torch.float32):
        super().__init__()
        if q.bits != 8:
            raise ValueError("Int8Embedding holds per-row INT8 codes")
        self.register_buffer("codes", q.codes.contiguous())  # (V, H) int8
        self.register_buffer("scale32", q.scale.float().contiguous())  # (V,)
        self.out_dtype = out_dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.codes[ids].float() * self.scale32[ids][..., None]).to(self.out_dtype)  # (..., H)
