"""The token embedding table: rows looked up per token and handed on in the model's dtype.

The table may be stored narrower than the model runs (fp16, bf16): only the looked-up rows are
widened, so the table costs its stored bytes, not float32's.
"""

from __future__ import annotations

import torch


class Embedding(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, out_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)  # (V, H)
        self.out_dtype = out_dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids].to(self.out_dtype)  # (..., H)
