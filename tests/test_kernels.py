"""The packed fp32 GEMM kernel against a float64 matmul, and the torch fallback against it."""

import pytest
import torch

from qbench.kernels import build
from qbench.kernels.ops import gemm_packed, pack_panels, unpack_panels
from qbench.layers import linear as linear_mod

needs_kernel = pytest.mark.skipif(not build.available(), reason="no C compiler or no AVX2/FMA here")


@needs_kernel
@pytest.mark.parametrize("M", [1, 2, 5, 6, 7, 8, 13, 64])
@pytest.mark.parametrize("N,K", [(960, 576), (50, 64), (2304, 768), (16, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_gemm_matches_float64(M, N, K, with_bias):
    g = torch.Generator().manual_seed(M * 1000 + N)
    W = torch.randn(N, K, generator=g)
    x = torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g) if with_bias else None
    P = pack_panels(W.t())
    ref = x.double() @ W.t().double() + (0 if b is None else b.double())
    got = gemm_packed(x, P, b, N)
    assert got.shape == (M, N)
    # float32 accumulation over K terms of magnitude ~1: error grows like sqrt(K) * eps * |terms|
    assert (got.double() - ref).abs().max() < 1e-5 * K ** 0.5 * 10


def test_pack_roundtrip_with_padding():
    W = torch.randn(37, 8)
    P = pack_panels(W.t())
    assert P.shape == (3, 8, 16)
    assert torch.equal(unpack_panels(P, 37), W.t())
    assert torch.count_nonzero(P[2, :, 5:]) == 0  # the padded columns are zero


@needs_kernel
def test_linear_kernel_and_torch_fallback_agree(monkeypatch):
    W, b = torch.randn(100, 48), torch.randn(100)
    x = torch.randn(3, 5, 48)
    fast = linear_mod.Linear(W, b)
    assert fast.packed is not None
    monkeypatch.setattr(build, "available", lambda: False)
    slow = linear_mod.Linear(W, b)
    assert slow.packed is None
    ref = torch.nn.functional.linear(x.double(), W.double(), b.double())
    assert (fast(x).double() - ref).abs().max() < 1e-4
    assert (slow(x).double() - ref).abs().max() < 1e-4
    assert torch.equal(fast.weight, W) and torch.equal(slow.weight, W)
    ids = torch.tensor([0, 17, 99])
    assert torch.equal(fast.rows(ids), W[ids]) and torch.equal(slow.rows(ids), W[ids])
