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


def _output_mse(X: torch.Tensor):
    """D (N, K) -> mean((X D^T)^2), the layer's output MSE for a weight error D, for the fixed X (T, K). With more
    tokens than input channels it reads X once, through G = X^T X: sum((D G) * D) / (T N) costs N K^2 instead of
    T K N per call (AWQ calls it once per grid point)."""
    T, K = X.shape
    if T <= K:
        return lambda D: (X @ D.t()).pow(2).mean().item()
    G = X.t() @ X  # (K, K)
    return lambda D: ((D @ G) * D).sum().item() / (T * D.shape[0])


def search_scales(X: torch.Tensor, W: torch.Tensor, bits: int, group: int | None, symmetric: bool,
                  grid: int = 20) -> tuple[torch.Tensor, dict]:
    """X (T, K) calibration inputs, W (N, K) -> best scales (K,) and the search record, in X's precision
    (float64 in a calibration: see wide.py)."""
    W = W.to(X.dtype)
    x_mean = X.abs().mean(0)
    w_mean = weight_mean(W, group)
    output_mse = _output_mse(X)
    best, best_loss, best_ratio, losses = None, float("inf"), None, []
    for i in range(grid):
        r = i / grid
        s = (x_mean.pow(r) / (w_mean.pow(1 - r) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        Wq = fake_quantize(W * s, bits, group, symmetric).to(X.dtype) / s
        loss = output_mse(Wq - W)
        losses.append(loss)
        if loss < best_loss:
            best, best_loss, best_ratio = s, loss, r
    return best, {"best_ratio": best_ratio, "best_mse": best_loss, "mse_at_ratio_0": losses[0]}


CLIP_TOKENS = 512  # calibration tokens the clipping search scores on (every n-th of the captured sample)
CLIP_ROWS = 1024  # output channels searched at a time: bounds the (tokens, rows, groups) partial outputs


def search_clip(X: torch.Tensor, W: torch.Tensor, bits: int, group: int | None, symmetric: bool,
                grid: int = 20, max_shrink: float = 0.5) -> tuple[torch.Tensor, dict]:
    """AWQ's clipping search (llm-awq's auto_clip): per output channel and group, the largest |w| the grid
    keeps, max|w| * (1 - i / grid) for i = 0 .. max_shrink * grid - 1, chosen by the MSE of the group's partial
    output X_g (Q(clamp(W_g)))^T against X_g W_g^T. X (T, K) calibration inputs, W (N, K) -> the clip values
    (N, ngroups) and a record, in X's precision. A whole row is one group for per-channel schemes (INT8)."""
    W = W.to(X.dtype)
    step = max(1, X.shape[0] // CLIP_TOKENS)
    X = X[::step][:CLIP_TOKENS]
    N, K = W.shape
    G = group or K
    Kp = padded_width(K, G)
    Xg = torch.nn.functional.pad(X, (0, Kp - K)).view(X.shape[0], -1, G).transpose(0, 1)  # (ng, T, G)
    Wg = torch.nn.functional.pad(W, (0, Kp - K)).view(N, -1, G)  # (N, ng, G)
    org_max = Wg.abs().amax(-1)  # (N, ng)
    shrinks = range(int(max_shrink * grid))
    factors = torch.tensor([1 - i / grid for i in shrinks], dtype=X.dtype)  # what each shrink multiplies max|w| by
    moved = torch.zeros(N, Wg.shape[1], dtype=torch.int64)  # the best shrink of each (row, group)
    for r0 in range(0, N, CLIP_ROWS):
        w = Wg[r0: r0 + CLIP_ROWS]  # (n, ng, G)
        ref = torch.bmm(Xg, w.permute(1, 2, 0))  # (ng, T, n)
        best = torch.full(w.shape[:2], float("inf"), dtype=X.dtype)
        for i in shrinks:
            m = org_max[r0: r0 + CLIP_ROWS] * factors[i]  # (n, ng)
            wc = torch.maximum(torch.minimum(w, m[..., None]), -m[..., None]).reshape(w.shape[0], -1)[:, :K]
            wq = fake_quantize(wc, bits, group, symmetric).to(X.dtype)
            wq = torch.nn.functional.pad(wq, (0, Kp - K)).view(w.shape)
            err = (torch.bmm(Xg, wq.permute(1, 2, 0)) - ref).pow(2).mean(1).t()  # (n, ng)
            better = err < best
            best = torch.where(better, err, best)
            moved[r0: r0 + CLIP_ROWS][better] = i
    return org_max * factors[moved], {"clipped_fraction": (moved > 0).float().mean().item(),
                                      "mean_shrink": (moved.float() / grid).mean().item()}


def apply_clip(W: torch.Tensor, max_val: torch.Tensor, group: int | None) -> torch.Tensor:
    """W (N, K) with each group's values clamped to +-max_val (N, ngroups), in max_val's precision."""
    N, K = W.shape
    G = group or K
    m = max_val.repeat_interleave(G, dim=1)[:, :K]
    W = W.to(m.dtype)
    return torch.maximum(torch.minimum(W, m), -m)
