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
    P = pack_panels(W)
    ref = x.double() @ W.t().double() + (0 if b is None else b.double())
    got = gemm_packed(x, P, b, N)
    assert got.shape == (M, N)
    # float32 accumulation over K terms of magnitude ~1: error grows like sqrt(K) * eps * |terms|
    assert (got.double() - ref).abs().max() < 1e-5 * K ** 0.5 * 10


def test_pack_roundtrip_with_padding():
    W = torch.randn(37, 8)
    P = pack_panels(W)
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


@needs_kernel
@pytest.mark.parametrize("window", [None, 5, 70])
@pytest.mark.parametrize("hd,bs,ctx", [(16, 4, (13, 9)), (64, 16, (150, 67)), (128, 16, (97, 33)), (36, 8, (75, 6)),
                                       (80, 16, (64, 130))])
def test_paged_attention_matches_the_torch_path(window, hd, bs, ctx):
    # contexts past the kernel's key chunk (32) and head sizes with and without its 64- and 8-wide paths
    from qbench.kernels.ops import paged_attention
    from qbench.layers.attention import AttnMetadata, build_mask
    from qbench.layers.kv import BlockKV

    g = torch.Generator().manual_seed(hd + bs)
    nkv, nh = 2, 6
    ctx = torch.tensor(ctx)  # tokens in each sequence's cache
    nblk = int(-(-ctx.max() // bs))
    nb = 2 * nblk + 3
    kp, vp = torch.randn(nb, bs, nkv, hd, generator=g), torch.randn(nb, bs, nkv, hd, generator=g)
    tables = torch.randperm(nb, generator=g)[:2 * nblk].view(2, nblk)
    T = 3
    pos = torch.stack([ctx[b] - T + torch.arange(T) for b in range(2)])  # last 3 tokens as queries
    valid = torch.tensor([[True, True, True], [True, True, False]])
    q = torch.randn(2, T, nh, hd, generator=g)
    got = paged_attention(q, kp, vp, tables, pos, valid, window, 0.25)
    # reference: gather through the tables, dense mask, softmax in float64
    meta = AttnMetadata(positions=pos, block_tables=tables, context_lens=ctx, slot_mapping=torch.zeros(0),
                        block_size=bs)
    mask = build_mask(meta, nh // nkv, window)
    keys, values = BlockKV(kp, vp).read(tables)
    qg = q.view(2, T, nkv, 3, hd).permute(0, 2, 1, 3, 4).reshape(2, nkv, T * 3, hd)
    s = (qg.double() @ keys.double().transpose(-1, -2)) * 0.25
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    ref = (p @ values.double()).view(2, nkv, T, 3, hd).permute(0, 2, 1, 3, 4).reshape(2, T, nh * hd)
    assert (got[valid] - ref[valid]).abs().max() < 1e-5
    assert torch.count_nonzero(got[~valid]) == 0


@needs_kernel
def test_fused_layer_ops_match_torch():
    from qbench.kernels.ops import rmsnorm, rope_, silu_mul
    from qbench.layers.rope import RopeTable, apply_rope

    x, w = torch.randn(5, 3, 576), torch.randn(576)
    ref = torch.nn.functional.rms_norm(x.double(), (576,), w.double(), 1e-5)
    assert (rmsnorm(x, w, 1e-5).double() - ref).abs().max() < 1e-5
    gu = torch.randn(4, 2 * 1536) * 6
    ref = torch.nn.functional.silu(gu[:, :1536].double()) * gu[:, 1536:].double()
    assert (silu_mul(gu).double() - ref).abs().max() < 1e-4
    table = RopeTable(64, 512, 10000.0)
    qkv = torch.randn(2, 7, 5, 64)
    pos = torch.randint(0, 512, (2, 7))
    cos, sin = table.lookup(pos, torch.float32)
    ref = apply_rope(qkv[:, :, :4], cos, sin)
    out = qkv.clone()
    rope_(out, pos, table.cos, table.sin, 4)
    assert (out[:, :, :4] - ref).abs().max() < 1e-5
    assert torch.equal(out[:, :, 4], qkv[:, :, 4])  # v heads are not rotated


@needs_kernel
@pytest.mark.parametrize("slab", [None, 64 * 48])  # one dense weight, or slabs of 64 columns (the last partial)
@pytest.mark.parametrize("N", [100, 131])
def test_prefill_sized_rows_take_the_dense_path_and_match_float64(monkeypatch, slab, N):
    """From DENSE_ROWS rows on, Linear unpacks its panels for oneDNN; the result is the same product."""
    if slab:
        monkeypatch.setattr(linear_mod, "SLAB_FLOATS", slab)
    g = torch.Generator().manual_seed(N)
    W, b = torch.randn(N, 48, generator=g), torch.randn(N, generator=g)
    lin = linear_mod.Linear(W, b)
    calls = []
    real = linear_mod.dense_matmul
    monkeypatch.setattr(linear_mod, "dense_matmul", lambda *a: calls.append(a[1].shape) or real(*a))
    for M in (linear_mod.DENSE_ROWS - 1, linear_mod.DENSE_ROWS + 3):
        x = torch.randn(M, 48, generator=g)
        ref = x.double() @ W.t().double() + b.double()
        assert (lin(x).double() - ref).abs().max() < 1e-5 * 48 ** 0.5 * 10
    widths = [s[1] for s in calls]  # only the second size went dense, in slabs that cover N once
    assert sum(widths) == N and (len(widths) == 1) == (slab is None)


@needs_kernel
@pytest.mark.parametrize("lengths,prefixes", [((9, 9), (0, 0)), ((9, 4), (0, 0)), ((1, 6), (0, 0)),
                                              ((9, 4), (7, 0)), ((5, 9), (16, 3)), ((12, 12), (40, 40))])
def test_prefill_attention_on_flash_matches_the_paged_kernel(monkeypatch, lengths, prefixes):
    """A prefill row attends causally over its new keys (torch's flash kernel) and fully over the prefix
    already in the cache (a second flash call, merged by log-sum-exp); the paged kernel over the same pool
    is the reference, padded rows included."""
    import qbench.layers.attention as attention_mod
    from qbench.kernels.ops import paged_attention
    from qbench.layers.attention import AttnMetadata, attend, uses_kernel
    from qbench.layers.kv import BlockKV

    g = torch.Generator().manual_seed(sum(lengths) + sum(prefixes))
    B, T, nh, nkv, hd, bs = len(lengths), max(lengths), 6, 2, 16, 4
    q, k, v = torch.randn(B, T, nh, hd, generator=g), torch.randn(B, T, nkv, hd, generator=g), \
        torch.randn(B, T, nkv, hd, generator=g)
    ctx = [p + n for p, n in zip(prefixes, lengths)]
    nblk = -(-max(ctx) // bs)
    tables = torch.randperm(B * nblk, generator=g).view(B, nblk)  # blocks scattered over the pool
    cache = BlockKV(torch.randn(B * nblk, bs, nkv, hd, generator=g), torch.randn(B * nblk, bs, nkv, hd, generator=g))
    valid = torch.tensor([[t < n for t in range(T)] for n in lengths])
    idx = valid.flatten().nonzero().flatten()
    slots = torch.cat([tables[b, (p + torch.arange(n)) // bs] * bs + (p + torch.arange(n)) % bs
                       for b, (p, n) in enumerate(zip(prefixes, lengths))])
    padded = bool((~valid).any())
    meta = AttnMetadata(positions=torch.stack([p + torch.arange(T) for p in prefixes]),
                        valid_index=idx if padded else None, query_valid=valid if padded else None,
                        slot_mapping=slots, block_tables=tables, context_lens=torch.tensor(ctx), block_size=bs,
                        new_tokens=torch.tensor(lengths))
    assert uses_kernel(meta, torch.float32)
    with monkeypatch.context() as m:
        m.setattr(attention_mod, "paged_attention", lambda *a: pytest.fail("a prefill took the paged kernel"))
        got = attend(q, k, v, None, meta, cache, 0.25)
    ref = paged_attention(q, cache.k, cache.v, tables, meta.positions, meta.query_valid, None, 0.25)
    assert (got[valid] - ref[valid]).abs().max() < 1e-5
    assert torch.count_nonzero(got[~valid]) == 0
