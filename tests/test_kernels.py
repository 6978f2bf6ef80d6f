"""The packed fp32 GEMM kernel against a float64 matmul, and the torch fallback against it."""

import pytest
import torch

from conftest import native_isas
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


def _fma_chain(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The slow, obviously fixed order: y[m, n] = fma(x[m, k], W[n, k], y) for k = 0, 1, .., K-1 from zero, then
    + b, in float32, one k at a time over whole columns. Each step is rounded once to float32 from float64,
    where x * W is exact; the float64 sum with y is exact too unless their exponents lie far apart, so this
    is a fused multiply-add but for a rare double rounding."""
    y = torch.zeros(x.shape[0], W.shape[0], dtype=torch.float32)
    xd, Wd = x.double(), W.double()
    for k in range(x.shape[1]):
        y = (y.double() + xd[:, k:k + 1] * Wd[:, k][None, :]).float()
    return y + (0 if b is None else b)


@needs_kernel
@pytest.mark.parametrize("N,K", [(100, 48), (131, 1100), (40, 7)])
def test_panel_gemm_is_one_fixed_order_chain_per_output(N, K):
    """Every output of the panel GEMM is one FMA chain over k in order, then + bias: so a row's bits do not
    depend on the call's other rows (below and above the 32-row blocking, K over its 512-value blocks), nor
    on the instruction set (the AVX-512 tiles against the AVX2 ones), and they are the chain's bits."""
    from qbench.kernels.ops import gemm_panels_into
    lib = build.load()
    # values on a coarse grid (multiples of 2^-6 up to 4): every product and partial sum is exact in float32,
    # so the chain's float32 result is the exact sum
    g = torch.Generator().manual_seed(N + K)
    grid = lambda *shape: torch.randint(-256, 257, shape, generator=g).float() / 64  # noqa: E731
    W, b = grid(N, K), grid(N)
    P = pack_panels(W)
    x = grid(300, K)
    exact = (x.double() @ W.double().t() + b.double()).float()
    try:
        for isa in (512, 256):
            if isa not in native_isas():
                continue
            lib.qb_set_isa(isa)
            whole = gemm_packed(x, P, b, N)
            assert torch.equal(whole, exact)
            for M in (1, 5, 31, 32, 33, 130):  # a row's bits alone and inside small, blocked and odd calls
                assert torch.equal(gemm_packed(x[:M], P, b, N), whole[:M]), (isa, M)
            # into a slab of a wider output: only its columns are written
            y = torch.full((40, N + 9), 7.0)
            gemm_panels_into(x[:40].contiguous(), P, b, y[:, 3:], N)
            assert torch.equal(y[:, 3:N + 3], whole[:40]) and (y[:, :3] == 7).all() and (y[:, N + 3:] == 7).all()
        # rounding that matters: random values, where the order shows in the last bits
        xr, Wr = torch.randn(64, K, generator=g), torch.randn(N, K, generator=g)
        Pr = pack_panels(Wr)
        chain = _fma_chain(xr, Wr, b)
        for isa in (512, 256):
            if isa not in native_isas():
                continue
            lib.qb_set_isa(isa)
            got = gemm_packed(xr, Pr, b, N)
            # the emulated chain rounds each step once from float64, as an FMA does, except where the float64
            # sum itself rounded (exponents far apart): all but a few outputs are the same bits
            assert (got != chain).float().mean() < 0.001, isa  # another order differs in most outputs
            assert torch.equal(got[:1], gemm_packed(xr[:1], Pr, b, N))
    finally:
        lib.qb_set_isa(native_isas()[-1])


@needs_kernel
@pytest.mark.parametrize("slab", [None, 64 * 48])  # one dequantized weight, or slabs of 64 columns
@pytest.mark.parametrize("N", [100, 131])
def test_dense_by_slabs_covers_every_column_once(monkeypatch, slab, N):
    """Quantized prefill dequantizes the weight in slabs of fp32 panels for the panel GEMM; the slabs cover N
    once, and the result is the panel GEMM's on the whole weight, bit for bit."""
    if slab:
        monkeypatch.setattr(linear_mod, "SLAB_FLOATS", slab)
    g = torch.Generator().manual_seed(N)
    W, b = torch.randn(N, 48, generator=g), torch.randn(N, generator=g)
    P = pack_panels(W)
    widths = []
    x = torch.randn(linear_mod.DENSE_ROWS + 3, 48, generator=g)
    got = linear_mod.dense_by_slabs(x, N, lambda p0, p1, c: widths.append(c) or P[p0:p1].contiguous(), b)
    assert torch.equal(got, gemm_packed(x, P, b, N))
    assert sum(widths) == N and (len(widths) == 1) == (slab is None)


@needs_kernel
@pytest.mark.parametrize("lengths,prefixes", [((9, 9), (0, 0)), ((9, 4), (0, 0)), ((1, 6), (0, 0)),
                                              ((9, 4), (7, 0)), ((5, 9), (16, 3)), ((12, 12), (40, 40)),
                                              ((100, 70), (0, 90))])  # two tiles of 64 queries, three key blocks
@pytest.mark.parametrize("hd", [16, 12])  # the fixed-order kernel; torch's flash kernel (hd not a multiple of 8)
def test_prefill_attention_matches_the_paged_kernel(monkeypatch, lengths, prefixes, hd):
    """A prefill row attends causally over its new keys and fully over the prefix already in the cache: in one
    pass of the fixed-order kernel (qb_prefill_attention), or in two flash calls merged by log-sum-exp; the
    paged kernel over the same pool is the reference, padded rows included. The fixed-order kernel gives each
    row the bits it gives alone, and its AVX-512 form the AVX2 form's bits."""
    import qbench.layers.attention as attention_mod
    from qbench.kernels.ops import paged_attention, prefill_attention
    from qbench.layers import prefill_attention as flash
    from qbench.layers.attention import AttnMetadata, attend, uses_kernel
    from qbench.layers.kv import BlockKV

    g = torch.Generator().manual_seed(sum(lengths) + sum(prefixes))
    B, T, nh, nkv, bs = len(lengths), max(lengths), 6, 2, 4
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
        if hd % 8 == 0:
            m.setattr(flash, "prefill_attention", lambda *a: pytest.fail("an fp32 pool's prefill took flash"))
        else:
            m.setattr(attention_mod, "prefill_attention", lambda *a: pytest.fail("hd 12 took the native kernel"))
        got = attend(q, k, v, None, meta, cache, 0.25)
    ref = paged_attention(q, cache.k, cache.v, tables, meta.positions, meta.query_valid, None, 0.25)
    assert (got[valid] - ref[valid]).abs().max() < 1e-5
    assert torch.count_nonzero(got[~valid]) == 0
    if hd % 8:
        return
    lib = build.load()
    try:
        for isa in (256, 512):
            if isa not in native_isas():
                continue
            lib.qb_set_isa(isa)
            assert torch.equal(prefill_attention(q, cache.k, cache.v, tables, meta.positions, valid, 0.25), got)
            for b, n in enumerate(lengths):  # a row alone, and its last query alone, give the batch's bits
                pos = meta.positions[b:b + 1]
                alone = prefill_attention(q[b:b + 1, :n], cache.k, cache.v, tables[b:b + 1], pos[:, :n], None, 0.25)
                assert torch.equal(alone, got[b:b + 1, :n])
                last = prefill_attention(q[b:b + 1, n - 1:n], cache.k, cache.v, tables[b:b + 1], pos[:, n - 1:n],
                                         None, 0.25)
                assert torch.equal(last, got[b:b + 1, n - 1:n])
    finally:
        lib.qb_set_isa(native_isas()[-1])


@needs_kernel
@pytest.mark.parametrize("n", [49157, 8, 5])
def test_log_softmax_kernel_matches_float64_and_each_row_alone(monkeypatch, n):
    """qb_log_softmax against a float64 log_softmax (within float32 rounding of the log-probs' size), the same
    bits for a row alone as in a batch, and the torch fallback (float64 sums) within the same bound."""
    from qbench.engine import scoring
    from qbench.kernels.ops import log_softmax
    g = torch.Generator().manual_seed(n)
    x = torch.randn(37, n, generator=g) * 6
    ref = torch.log_softmax(x.double(), dim=-1)
    got = log_softmax(x)
    bound = 4 * torch.finfo(torch.float32).eps * (1 + ref.abs())
    assert ((got.double() - ref).abs() <= bound).all()
    assert torch.equal(log_softmax(x[5:6]), got[5:6])
    assert torch.equal(scoring.log_softmax(x), got)
    monkeypatch.setattr(scoring.kernels, "available", lambda: False)
    assert ((scoring.log_softmax(x).double() - ref).abs() <= bound).all()


@needs_kernel
def test_the_dispatch_never_takes_avx512_on_a_cpu_without_it():
    """qb_set_isa(512) keeps AVX2 where the CPU lacks AVX-512 (F, BW, VL and VNNI, as /proc/cpuinfo lists them):
    a test that restored the dispatch with qb_set_isa(512) sent every later kernel call on an AVX2-only EPYC into
    AVX-512 code, and the process died on an illegal instruction."""
    lib = build.load()
    has = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= build.cpu_info()[1]
    try:
        lib.qb_set_isa(512)
        assert lib.qb_isa() == (512 if has else 256)
        lib.qb_set_isa(256)
        assert lib.qb_isa() == 256
    finally:
        lib.qb_set_isa(native_isas()[-1])
