"""GPTQ: quantize one column at a time and push its error onto the columns not yet quantized,
weighted by the inverse Hessian of the layer's calibration inputs (Frantar et al., 2022).

H = X^T X / n from calibration inputs; 1% damping of the mean diagonal; lazy updates in blocks of
128 columns; act-order (columns by decreasing Hessian diagonal) as an option. With act-order the
group parameters are fixed from the original weights ("static groups") so that groups stay
contiguous runs of input channels, as the packed layout requires.

The column loop inside a block is one native call per stretch of columns that share their group
parameters (qbench/kernels/gptq.c, rows in parallel); the torch loop (``columns_reference``) is its
reference and the fallback without kernels, and the two agree bit for bit.
"""

from __future__ import annotations

import torch

from qbench.quant.primitives import QTensor, int4_params, padded_width


def _params(w: torch.Tensor, bits: int, group: int | None, symmetric: bool):
    """Scale and zero for a slice (N, cols), as (N, 1) float tensors; zero is None when symmetric."""
    if bits == 8:
        return (w.abs().amax(1, keepdim=True) / 127.0).clamp(min=1e-8).half().float(), None
    s, z = int4_params(w, group, symmetric)  # one group; a partial last group is zero-padded, as in RTN
    return s.float(), (None if z is None else z.float())


def _quant_col(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, bits: int):
    """Column (N,) -> (codes, dequantized) under (N,) scale/zero."""
    if bits == 8:
        q = torch.clamp(torch.round(w / s), -127, 127)
        return q, q * s
    if z is None:
        q = torch.clamp(torch.round(w / s), -8, 7)
        return q + 8, q * s
    q = torch.clamp(torch.round(w / s) + z, 0, 15)
    return q, (q - z) * s


GRAM_BLOCK = 192  # columns per block of X^T X's lower triangle; see ``gram``


def gram(x: torch.Tensor) -> torch.Tensor:
    """x^T x for x (m, K), exactly symmetric. Wider than one block, only the lower triangle's column blocks are
    multiplied and mirrored: about (1 + 192 / K) / 2 of the full product's work (SmolLM2's 1,536-wide down_proj
    56%, a 4,864-wide Qwen down_proj 52%). Why 192: MKL's float64 kernels tile a product's columns by a width
    that divides 96 on the AVX2 EPYC (widths of 96, 192 and 384 gave the full product's bits; 64, 128, 256 and
    512 other bits, and ran 1.3-1.5x slower: a ragged edge takes other kernels). 192 is also a multiple of 8,
    16, 24, 32 and 64, other likely tile widths; MKL's AVX-512 kernels were not measured. On that EPYC, at
    16,384 tokens: K = 576 170 -> 111 ms, 1,536 864 -> 662 ms (medians of 5)."""
    K = x.shape[1]
    if K <= GRAM_BLOCK:
        G = x.t() @ x
    else:
        G = torch.empty(K, K, dtype=x.dtype)
        for j in range(0, K, GRAM_BLOCK):  # G[j:, j:j+b] = x[:, j:]^T x[:, j:j+b]
            torch.mm(x[:, j:].t(), x[:, j: j + GRAM_BLOCK], out=G[j:, j: j + GRAM_BLOCK])
    return torch.tril(G) + torch.tril(G, -1).t()


def quadratic_trace(D: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """tr(D H D^T) for D (N, K) and H (K, K) symmetric, from H's lower triangle: each column block b adds
    D_b H_bb D_b^T once and the blocks below it, D_a H_ab D_b^T for a > b, twice (their mirror images above the
    diagonal are equal), so about (1 + GRAM_BLOCK / K) / 2 of the work of the full product (D H) * D."""
    K = H.shape[0]
    t = D.new_zeros(())
    for j in range(0, K, GRAM_BLOCK):
        e = min(j + GRAM_BLOCK, K)
        Db = D[:, j:e]  # (N, b)
        t = t + ((Db @ H[j:e, j:e]) * Db).sum()
        if e < K:
            t = t + 2 * ((D[:, e:] @ H[e:, j:e]) * Db).sum()
    return t


def hessian_add(H: torch.Tensor | None, x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """Running mean of x^T x over calibration tokens; x (..., K), all in float64. The reference GPTQ forms the
    product in float32, whose last bits depend on the BLAS path and thread count; float64 makes the artifact
    the same on every machine (wide.py)."""
    x = x.reshape(-1, x.shape[-1]).double()
    m = x.shape[0]
    H = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64) if H is None else H
    H *= n / (n + m)
    H += gram(x) / (n + m)
    return H, n + m


def inverse_cholesky(H: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor U of H^-1 (H^-1 = U^T U), which GPTQ's updates read row by row.

    With J the order-reversing permutation and J H J = L L^T: H = (J L J)(J L J)^T, whose first factor is upper
    triangular, so H^-1 = U^T U with U = (J L J)^-1 = J L^-1 J. One Cholesky and one triangular solve, instead
    of Cholesky, inverse and Cholesky again (torch's cholesky_inverse took 12 s at K = 1,536 on a 2-core EPYC,
    this 0.3 s); the two agree to 3e-16 relative.
    A BLAS product X^T X need not be exactly symmetric, so the lower triangle is mirrored first."""
    H = torch.tril(H) + torch.tril(H, -1).t()  # Cholesky reads one triangle: the lower one, as before the flip
    L = torch.linalg.cholesky(H.flip(0, 1))
    return lower_inverse(L).flip(0, 1)


TRI_BLOCK = 768  # columns of L^-1 per triangular solve in ``lower_inverse``


def lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """L^-1 for L (K, K) lower triangular. The inverse is lower triangular too: its columns j .. j+b-1 are zero
    above row j and solve L[j:, j:] X = I[j:, j:j+b], so solving block by block skips the zeros that one solve
    against the whole identity computes (K^3 / 3 multiply-adds in all instead of K^3). On the 2-core AVX2 EPYC
    a 4,864-wide factor (Qwen2.5-Coder-0.5B's down_proj) took 2.0 s, now 1.1 s; blocks of 512 or 1,024
    columns ran between the two."""
    K = L.shape[0]
    X = torch.zeros_like(L)
    for j in range(0, K, TRI_BLOCK):
        e = min(j + TRI_BLOCK, K)
        X[j:, j:e] = torch.linalg.solve_triangular(L[j:, j:], torch.eye(K - j, e - j, dtype=L.dtype), upper=False)
    return X


def columns_reference(W1, Hinv1, c0: int, c1: int, gidx, scales, zeros, bits: int, codes1, Err1) -> None:
    """Columns c0 .. c1-1 of a block, one at a time (the reference loop): W1, codes1, Err1 (N, B) float64 are
    written in place; column i's group parameters are scales / zeros[:, gidx[i]]."""
    for i in range(c0, c1):
        g = int(gidx[i])
        q, dq = _quant_col(W1[:, i], scales[:, g], None if zeros is None else zeros[:, g], bits)
        codes1[:, i] = q
        err = (W1[:, i] - dq) / Hinv1[i, i]
        W1[:, i + 1:] -= err[:, None] * Hinv1[i, i + 1:][None, :]
        Err1[:, i] = err


def columns_native(W1, Hinv1, c0: int, c1: int, gidx, scales, zeros, bits: int, codes1, Err1) -> None:
    """``columns_reference`` in one native call (qbench/kernels/gptq.c), bit for bit, rows in parallel."""
    from qbench.kernels.build import load
    N, B = W1.shape
    if not all(t.is_contiguous() and t.dtype == torch.float64 for t in (W1, Hinv1, codes1, Err1)):
        raise ValueError("columns_native: W1, Hinv1, codes1 and Err1 must be contiguous float64 (it reads raw rows)")
    gidx = gidx.to(torch.int64).contiguous()
    scales_c = scales.contiguous()
    zeros_c = None if zeros is None else zeros.contiguous()
    load().qb_gptq_block(W1.data_ptr(), Hinv1.data_ptr(), N, B, c0, c1, gidx.data_ptr(), scales_c.data_ptr(),
                         0 if zeros_c is None else zeros_c.data_ptr(), scales.shape[1], bits, codes1.data_ptr(),
                         Err1.data_ptr(), torch.get_num_threads())


def _columns():
    from qbench.kernels.build import available
    return columns_native if available() else columns_reference


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, bits: int, group: int | None, symmetric: bool,
                  damp: float = 0.01, block: int = 128, act_order: bool = False) -> QTensor:
    N, K = W.shape
    # own row-major copies: the native column loop reads W's blocks as (N, B) rows, and the engine stores a
    # linear's weight transposed (strides (1, N)), which a plain clone would keep
    W = W.to(torch.float64, copy=True, memory_format=torch.contiguous_format)
    H = H.to(torch.float64, copy=True, memory_format=torch.contiguous_format)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    G = group if bits == 4 else None
    Kp = padded_width(K, G) if G else K
    ngroups = Kp // G if G else 1
    scales = torch.zeros(N, ngroups, dtype=torch.float64)
    zeros = None if (bits == 8 or symmetric) else torch.zeros(N, ngroups, dtype=torch.float64)
    perm = torch.argsort(torch.diag(H), descending=True, stable=True) if act_order else torch.arange(K)
    static = act_order or bits == 8
    if static:  # parameters from the original weights, per original group (or per row for INT8)
        for g in range(ngroups):
            cols = slice(g * G, min((g + 1) * G, K)) if G else slice(0, K)
            s, z = _params(W[:, cols].float(), bits, G, symmetric)
            scales[:, g] = s[:, 0].double()
            if zeros is not None:
                zeros[:, g] = z[:, 0].double()
    if act_order:  # without it perm is the identity: no copies of H (a 4,864-wide one is 189 MB)
        W, H = W[:, perm], H[perm][:, perm]
    H.diagonal().add_(damp * torch.mean(torch.diag(H)))  # H + c I, the same values without a (K, K) identity
    Hinv = inverse_cholesky(H)
    columns = _columns()
    codes = torch.zeros(N, K, dtype=torch.float64)
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1 = W[:, i1:i2].clone()  # (N, B)
        Err1 = torch.zeros_like(W1)
        codes1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2].contiguous()
        cols = perm[i1:i2]  # original input channels of the block's columns
        gidx = cols // G if G else torch.zeros_like(cols)
        # where a group is entered (non-static): its parameters come from the weights updated so far, so the
        # block is run in segments that end there
        starts = [] if static else [i for i in range(i2 - i1) if int(cols[i]) % G == 0]
        bounds = sorted({0, *starts, i2 - i1})
        for c0, c1 in zip(bounds[:-1], bounds[1:]):
            if c0 in starts:
                col, g = int(cols[c0]), int(gidx[c0])
                width = min(G, K - col)
                s, z = _params(W1[:, c0: c0 + width].float() if c0 + width <= i2 - i1 else
                               torch.cat([W1[:, c0:], W[:, i2: i1 + c0 + width]], 1).float(), bits, G, symmetric)
                scales[:, g] = s[:, 0].double()
                if zeros is not None:
                    zeros[:, g] = z[:, 0].double()
            columns(W1, Hinv1, c0, c1, gidx, scales, zeros, bits, codes1, Err1)
        codes[:, i1:i2] = codes1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    inv = torch.argsort(perm)
    codes = codes[:, inv]
    if bits == 8:
        return QTensor(8, codes.to(torch.int8), scales[:, 0].half(), None, None, (N, K))
    pad_code = 8 if zeros is None else 0
    full = torch.full((N, Kp), pad_code, dtype=torch.float64)
    full[:, :K] = codes
    if zeros is not None:  # padded columns must dequantize to exactly zero
        full[:, K:] = zeros[:, -1:].expand(N, Kp - K)
    return QTensor(4, full.to(torch.uint8), scales.half(), None if zeros is None else zeros.to(torch.uint8), G, (N, K))
