"""An online Hadamard rotation of a linear's inputs (QuaRot's and SpinQuant's R4 on ``down_proj``): y = x W^T =
(x H)(W H / b)^T, with H the block-diagonal Sylvester Hadamard matrix of blocks of b (entries +-1, H H = b I).

x H spreads an outlier channel over its block, so the per-token INT8 grid of the rotated input is about
sqrt(b) times finer where an outlier set its scale; the weight takes H / b once, offline, before it is
quantized. The rotation is not normalised at run time: its butterflies are exact fp32 additions and
subtractions in one fixed order (stage by stage, h = 1, 2, 4, ..), so torch here and ``qb_fwht`` in C give the
same bits on every instruction set, and the 1 / b (a power of two) is exact in the weights.
"""

from __future__ import annotations

import torch

MAX_BLOCK = 512  # SmolLM2's down_proj (K = 1,536 = 3 x 512) measured best at 512 of 64 .. 512
MIN_BLOCK = 16


def block_for(k: int) -> int:
    """The rotation's block for an input width k: the largest power of two of at most MAX_BLOCK dividing k
    (Qwen2.5-0.5B's 4,864 = 19 x 256 -> 256). Below MIN_BLOCK there is no outlier to spread: 0, refused."""
    b = 1
    while b < MAX_BLOCK and k % (2 * b) == 0:
        b *= 2
    return b if b >= MIN_BLOCK else 0


def fwht(x: torch.Tensor, block: int) -> torch.Tensor:
    """x H along the last dimension (..., K), H block-diagonal of Sylvester Hadamard blocks of ``block``
    (unnormalised: entries +-1); a new tensor of x's dtype."""
    K = x.shape[-1]
    assert block >= 2 and block & (block - 1) == 0 and K % block == 0, (K, block)
    lead = x.shape[:-1]
    y = x.reshape(-1, K).clone()  # (M, K), worked on in place
    h = 1
    while h < block:
        pairs = y.view(y.shape[0], K // (2 * h), 2, h)  # pairs (i, i + h) of each run of 2h
        a, c = pairs[:, :, 0], pairs[:, :, 1]
        t = a.clone()
        a.add_(c)
        c.sub_(t).neg_()  # -(c - t) is t - c exactly
        h *= 2
    return y.view(*lead, K)


def rotate_weight(w: torch.Tensor, block: int) -> torch.Tensor:
    """W (N, K) -> W H / b: the weight that meets x H (H symmetric, so each row is rotated)."""
    return fwht(w, block) / block


def rotate_hessian(h: torch.Tensor, block: int) -> torch.Tensor:
    """E[x^T x] (K, K) -> E[(x H)^T (x H)] = H E[x^T x] H."""
    return fwht(fwht(h, block).t(), block).t().contiguous()
