"""AWQ: activation-aware per-input-channel scales, searched over a grid (Lin et al., 2023).

For each mapping (a smoothing op -> the linears that read its output) the search tries
s = mean|x|^r / mean|w|^(1-r) (normalised), r = 0, 1/n, ..., (n-1)/n, quantizes W * s, and keeps
the s whose layer output X (Q(W s) / s)^T has the lowest MSE against the fp output X W^T, as
llm-compressor does. The smoothing op is then divided by s (a norm's weight, or the rows of the
previous linear), so the fp model is unchanged and only the quantization grid moves.
"""

from __future__ import annotations

import torch

from qbench.quant.primitives import fake_quantize, padded_width


def weight_mean(W: torch.Tensor, group: int | None) -> torch.Tensor:
    """Per-input-channel mean of |W| normalised within each group (row for per-channel schemes)."""
    N, K = W.shape
    if group is None:
        w = W.abs() / W.abs().amax(1, keepdim=True).clamp(min=1e-8)
        return w.mean(0)
    Wp = torch.nn.functional.pad(W.abs(), (0, padded_width(K, group) - K)).view(N, -1, group)
    w = (Wp / Wp.amax(-1, keepdim=True).clamp(min=1e-8)).view(N, -1)[:, :K]
    return w.mean(0)


def search_scales(X: torch.Tensor, W: torch.Tensor, bits: int, group: int | None, symmetric: bool,
                  grid: int = 20) -> tuple[torch.Tensor, dict]:
    """X (T, K) calibration inputs, W (N, K) -> best scales (K,) and the search record."""
    X, W = X.float(), W.float()
    ref = X @ W.t()
    x_mean = X.abs().mean(0)
    w_mean = weight_mean(W, group)
    best, best_loss, best_ratio, losses = None, float("inf"), None, []
    for i in range(grid):
        r = i / grid
        s = (x_mean.pow(r) / (w_mean.pow(1 - r) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        Wq = fake_quantize(W * s, bits, group, symmetric) / s
        loss = (X @ Wq.t() - ref).pow(2).mean().item()
        losses.append(loss)
        if loss < best_loss:
            best, best_loss, best_ratio = s, loss, r
    return best, {"best_ratio": best_ratio, "best_mse": best_loss, "mse_at_ratio_0": losses[0]}
