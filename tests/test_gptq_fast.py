"""GPTQ's fast path: the native column loop against the torch loop (bit for bit), the blocked algorithm
against an unblocked textbook GPTQ, and the inverse-Hessian factor against a float64 inverse."""

import pytest
import torch

from qbench.kernels import build
from qbench.quant import gptq
from qbench.quant.primitives import dequantize

needs_kernel = pytest.mark.skipif(not build.available(), reason="no C compiler or no AVX2/FMA here")


def _hessian(K: int, seed: int, n: int = 600) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, K, generator=g) * (torch.rand(K, generator=g) * 3 + 0.1)  # uneven channel scales
    H, _ = gptq.hessian_add(None, X, 0)
    return H


def _segment_inputs(N, B, bits, sym, seed):
    g = torch.Generator().manual_seed(seed)
    H = _hessian(B, seed) + 0.01 * torch.eye(B, dtype=torch.float64)
    Hinv1 = gptq.inverse_cholesky(H).contiguous()
    W1 = torch.randn(N, B, generator=g, dtype=torch.float64) * 0.05
    ngroups = 3
    gidx = torch.randint(0, ngroups, (B,), generator=g)
    scales = torch.rand(N, ngroups, generator=g, dtype=torch.float64) * 0.02 + 0.002
    zeros = None if (bits == 8 or sym) else torch.randint(0, 16, (N, ngroups), generator=g).double()
    return W1, Hinv1, gidx, scales, zeros


@needs_kernel
@pytest.mark.parametrize("bits,sym", [(4, True), (4, False), (8, True)])
@pytest.mark.parametrize("N,B,c0,c1", [(1, 128, 0, 128), (7, 100, 0, 100), (64, 128, 32, 96), (33, 48, 47, 48),
                                       (200, 128, 0, 64)])
def test_the_native_column_loop_equals_the_torch_loop_bit_for_bit(bits, sym, N, B, c0, c1):
    W1, Hinv1, gidx, scales, zeros = _segment_inputs(N, B, bits, sym, seed=N * 7 + B)
    outs = []
    for fn in (gptq.columns_reference, gptq.columns_native):
        w, codes, err = W1.clone(), torch.zeros_like(W1), torch.zeros_like(W1)
        fn(w, Hinv1, c0, c1, gidx, scales, zeros, bits, codes, err)
        outs.append((w, codes, err))
    (w_r, c_r, e_r), (w_n, c_n, e_n) = outs
    assert torch.equal(c_n, c_r) and torch.equal(e_n, e_r)
    assert torch.equal(w_n[:, c0 + 1:], w_r[:, c0 + 1:])  # every column the loop updates
    assert torch.count_nonzero(e_r[:, c0:c1]) > 0


def _same(a, b) -> bool:
    return (torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
            and (a.zero is None) == (b.zero is None) and (a.zero is None or torch.equal(a.zero, b.zero)))


@needs_kernel
@pytest.mark.parametrize("bits,group,sym,act_order,block", [
    (4, 128, True, False, 128), (4, 64, False, False, 128), (4, 32, True, False, 128), (8, None, True, False, 128),
    (4, 128, True, True, 128), (4, 64, False, False, 100), (4, 128, False, True, 48)])
def test_gptq_gives_the_same_codes_with_and_without_kernels(bits, group, sym, act_order, block, monkeypatch):
    N, K = 96, 300  # K not a multiple of the group: a padded last group
    H = _hessian(K, seed=K + block)
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(1)) * 0.05
    fast = gptq.gptq_quantize(W, H, bits, group, sym, block=block, act_order=act_order)
    monkeypatch.setattr(gptq, "_columns", lambda: gptq.columns_reference)
    slow = gptq.gptq_quantize(W, H, bits, group, sym, block=block, act_order=act_order)
    assert _same(fast, slow)


def textbook_gptq(W: torch.Tensor, H: torch.Tensor, group: int, damp: float = 0.01) -> torch.Tensor:
    """Unblocked GPTQ, INT4 symmetric, no act-order: each column quantized with its group's parameters taken
    from the weights updated so far, its error pushed at once onto every later column. -> dequantized (N, K)."""
    from qbench.quant.primitives import int4_params
    N, K = W.shape
    W = W.double().clone()
    H = H.double() + damp * torch.diag(H).mean() * torch.eye(K, dtype=torch.float64)
    U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    out = torch.zeros_like(W)
    s = None
    for i in range(K):
        if i % group == 0:
            s = int4_params(W[:, i: i + group].float(), group, True)[0].double()[:, 0]
        q = torch.clamp(torch.round(W[:, i] / s), -8, 7)
        out[:, i] = q * s
        err = (W[:, i] - out[:, i]) / U[i, i]
        W[:, i:] -= err[:, None] * U[i, i:][None, :]
    return out


def test_the_blocked_algorithm_equals_textbook_gptq():
    N, K = 64, 384
    H = _hessian(K, seed=3, n=2000)
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(2)) * 0.05
    ref = textbook_gptq(W, H, 128)
    got = dequantize(gptq.gptq_quantize(W, H, 4, 128, True, block=128)).double()
    # the same algorithm in another float64 order: a code may flip only where a value sits on a rounding edge
    assert (got != ref).float().mean() < 1e-3
    X = torch.randn(500, K, dtype=torch.float64)
    rel = ((X @ (got - ref).t()).norm() / (X @ W.double().t()).norm()).item()
    assert rel < 1e-3


@pytest.mark.parametrize("K", [7, 128, 577])
def test_inverse_cholesky_is_the_upper_factor_of_the_inverse(K):
    H = _hessian(K, seed=K) + 0.01 * torch.eye(K, dtype=torch.float64)
    U = gptq.inverse_cholesky(H)
    H = torch.tril(H) + torch.tril(H, -1).t()  # the float32 product is symmetric only to rounding
    assert torch.equal(U, torch.triu(U)) and bool((torch.diag(U) > 0).all())
    tol = 1e-14 * torch.linalg.cond(H).item()  # float64 rounding, amplified by H's conditioning
    eye = torch.eye(K, dtype=torch.float64)
    assert (U @ H @ U.t() - eye).abs().max().item() < tol  # U^T U = H^-1  <=>  U H U^T = I
    old = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    assert ((U - old).abs().max() / old.abs().max()).item() < tol


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_the_capture_pass_stops_at_down_proj_and_captures_what_a_full_forward_sees(tiny_models, family):
    from qbench.models.registry import load_model
    from qbench.quant.passes import block_forward, capture
    model = load_model(tiny_models[family][0])
    block = model.blocks[0]
    x = torch.randn(2, 24, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    names = ["qkv", "o_proj", "down_proj"]
    seen, hooks = {}, []
    for n in names:
        hooks.append(block.get_submodule(n).register_forward_hook(
            lambda mod, args, out, n=n: seen.__setitem__(n, args[0].reshape(-1, args[0].shape[-1]).clone())))
    with torch.inference_mode():
        block_forward(model.config, block, x)
        for h in hooks:
            h.remove()
        store = capture(model.config, block, x, names, max_tokens=4096)
    for n in names:
        assert torch.equal(store[n], seen[n])
        H, _ = gptq.hessian_add(None, seen[n], 0)
        assert torch.equal(store["H:" + n], H)
