"""Every fast path against dequantize-then-matmul in float64."""

import pytest
import torch

from conftest import native_isas

from qbench.kernels import build
from qbench.quant.primitives import dequantize, quantize_int4, quantize_int8
from qbench.quant.qlinear import Int4Linear, make_qlinear

IMPLS = ["native", "aten", "aten-bf16", "reference"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scheme", ["int8", "g32-sym", "g64-asym", "g128-sym", "g128-asym"])
@pytest.mark.parametrize("N,K", [(48, 576), (40, 96), (200, 1536), (24, 77)])
@pytest.mark.parametrize("M", [1, 2, 3, 8, 13, 259])  # 259: past DENSE_ROWS, dequantize + oneDNN
def test_fast_paths_match_the_reference(impl, scheme, N, K, M):
    if impl == "native" and not build.available():
        pytest.skip("native kernels not built here (no C compiler, or no AVX2/FMA/F16C)")
    g = torch.Generator().manual_seed(N + K + M)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    x = torch.randn(M, K, generator=g)
    if scheme == "int8":
        q = quantize_int8(w)
    else:
        group, sym = int(scheme[1:].split("-")[0]), scheme.endswith("sym") and not scheme.endswith("asym")
        q = quantize_int4(w, group, sym)
    ref = torch.nn.functional.linear(x.double(), dequantize(q).double(), b.double())
    got = make_qlinear(q, b, impl)(x).double()
    # stated tolerance: fp32 accumulation over K terms, relative to the output scale; qbench's INT4
    # kernel also rounds activations to int16 per group (at most 1.5e-5 of the group's absmax)
    tol = 2e-6 * K ** 0.5 * ref.abs().max() + 1e-5
    if impl == "native" and q.bits == 4:
        tol += 1.6e-5 * (dequantize(q).double().abs() @ x.double().abs().t()).max()
    if impl == "aten-bf16":  # bf16 activations and scales: 8 bits of mantissa, relative error 2^-8 each
        tol += 2 ** -7 * (dequantize(q).double().abs() @ x.double().abs().t()).max()
    assert (got - ref).abs().max() <= tol


@pytest.mark.skipif(not build.available() or build.load().qb_isa() != 512, reason="needs the native kernels on a CPU with AVX-512 VNNI")
@pytest.mark.parametrize("group,sym", [(32, True), (64, False), (128, True), (128, False)])
@pytest.mark.parametrize("N,K", [(48, 576), (40, 96), (200, 1536), (24, 77), (16, 130)])
def test_the_avx512_int4_path_is_bit_identical_to_the_avx2_path(group, sym, N, K):
    # both sum a group's int16 x int4 products exactly in int32 and close it with the same float ops
    g = torch.Generator().manual_seed(N * K + group)
    lin = make_qlinear(quantize_int4(torch.randn(N, K, generator=g), group, sym), None, "native")
    lib = build.load()
    for M in (1, 2, 5, 7, 13, 16, 17, 33):  # 3 rows and more: tiles of up to 16 rows, one accumulator per row
        x = torch.randn(M, K, generator=g)
        try:
            lib.qb_set_isa(256)
            narrow = lin(x)
        finally:
            lib.qb_set_isa(512)
        assert torch.equal(lin(x), narrow)


def test_group_scale_is_applied_once_per_group_in_the_kernel_layout():
    q = quantize_int4(torch.randn(32, 256), 64)
    lin = make_qlinear(q, None, "native" if build.available() else "aten")
    assert isinstance(lin, Int4Linear)
    if lin.impl == "native":
        assert lin.scales16.shape == (2, 4, 16)  # one scale per (panel, group, column), not per element
        assert lin.panels.shape == (2, 128, 16)  # two codes per byte, k in pairs


def test_leading_dimensions_and_bias():
    q = quantize_int8(torch.randn(24, 64))
    x = torch.randn(2, 5, 64)
    b = torch.randn(24)
    y = make_qlinear(q, b)(x)
    assert y.shape == (2, 5, 24)
    assert torch.allclose(y, torch.nn.functional.linear(x, dequantize(q), b), atol=1e-4)


@pytest.mark.skipif(not build.available(), reason="native kernels not built here (no C compiler, or no AVX2/FMA/F16C)")
@pytest.mark.parametrize("scheme", ["int8", "g32-sym", "g128-asym"])
@pytest.mark.parametrize("N,K", [(200, 1536), (24, 77), (131, 130)])
def test_the_prefill_path_dequantizes_exactly_the_reference_weights(monkeypatch, scheme, N, K):
    """At prefill sizes the native path dequantizes into fp32 panels for the panel GEMM; the weights it builds
    must equal ``dequantize`` bit for bit, including slabs that split the panels (the last one partial)."""
    from qbench.kernels.ops import unpack_panels
    from qbench.layers import linear as linear_mod

    g = torch.Generator().manual_seed(N * K)
    w = torch.randn(N, K, generator=g)
    q = quantize_int8(w) if scheme == "int8" else quantize_int4(w, int(scheme[1:].split("-")[0]),
                                                                scheme.endswith("-sym"))
    seen = []
    real = linear_mod.gemm_panels_into
    monkeypatch.setattr(linear_mod, "gemm_panels_into", lambda x2, panels, b, y, n: seen.append(
        unpack_panels(panels, n).clone()) or real(x2, panels, b, y, n))
    monkeypatch.setattr(linear_mod, "SLAB_FLOATS", 48 * K)  # slabs of 48 columns
    lin = make_qlinear(q, None, "native")
    lin(torch.randn(linear_mod.DENSE_ROWS, K, generator=g))
    assert torch.equal(torch.cat(seen, dim=1), dequantize(q).t())
    seen.clear()
    lin(torch.randn(linear_mod.DENSE_ROWS - 1, K, generator=g))
    assert not seen  # below DENSE_ROWS the integer kernels run


@pytest.mark.skipif(not build.available() or build.load().qb_isa() != 512, reason="needs the native kernels on a CPU with AVX-512 VNNI")
@pytest.mark.parametrize("N,K", [(48, 576), (40, 96), (200, 1536), (24, 77), (131, 130), (16, 3)])
def test_the_avx512_int8_path_is_bit_identical_to_the_avx2_path(N, K):
    # both sum each column's k in one chain, in order, with FMA, and scale once: an INT8 head's logits (and a
    # greedy answer near a tie) must not depend on the CPU kind; whatever the rows, panels per tile or threads
    g = torch.Generator().manual_seed(N * K)
    lin = make_qlinear(quantize_int8(torch.randn(N, K, generator=g)), None, "native")
    lib = build.load()
    threads = torch.get_num_threads()
    try:
        for M in (1, 2, 3, 5, 7, 8, 13, 16, 17, 33):
            x = torch.randn(M, K, generator=g) * 3
            lib.qb_set_isa(256)
            narrow = lin(x)
            lib.qb_set_isa(512)
            for nt in sorted({1, threads}):
                torch.set_num_threads(nt)
                assert torch.equal(lin(x), narrow), (M, nt)
            torch.set_num_threads(threads)
    finally:
        lib.qb_set_isa(512)
        torch.set_num_threads(threads)


@pytest.mark.skipif(not build.available() or build.load().qb_isa() != 512, reason="needs the native kernels on a CPU with AVX-512 VNNI")
@pytest.mark.parametrize("M", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("N,K", [(48, 576), (40, 97), (131, 130)])
def test_the_int8_kernel_on_both_isas_matches_the_reference(M, N, K):
    """INT8 has an AVX-512 kernel (one zmm per panel row) beside the AVX2 one; both against float64."""
    lib = build.load()
    g = torch.Generator().manual_seed(M * N + K)
    w, x = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)
    q = quantize_int8(w)
    ref = x.double() @ dequantize(q).double().t()
    lin = make_qlinear(q, None, "native")
    tol = 2e-6 * K ** 0.5 * ref.abs().max() + 1e-5
    try:
        for isa in (256, 512):
            lib.qb_set_isa(isa)
            assert (lin(x).double() - ref).abs().max() <= tol, isa
    finally:
        lib.qb_set_isa(512)


@pytest.mark.skipif(not build.available(), reason="native kernels not built here (no C compiler, or no AVX2/FMA/F16C)")
@pytest.mark.parametrize("scheme", ["fp32", "int8", "g64-asym", "g128-sym"])
@pytest.mark.parametrize("N,K", [(48, 576), (200, 1536), (40, 97), (131, 130), (16, 64)])
def test_a_rows_result_does_not_depend_on_how_many_rows_share_the_call(scheme, N, K):
    """Batched decode equals sequential decode bit for bit only if every kernel sums a row the same way
    whatever the number of rows (1 and 2 rows take their own latency-hiding tiles) on every instruction set."""
    from qbench.layers.linear import DENSE_ROWS, Linear

    g = torch.Generator().manual_seed(N * K + len(scheme))
    w = torch.randn(N, K, generator=g)
    if scheme == "fp32":
        lin = Linear(w, torch.randn(N, generator=g))
    elif scheme == "int8":
        lin = make_qlinear(quantize_int8(w), None, "native")
    else:
        lin = make_qlinear(quantize_int4(w, int(scheme[1:].split("-")[0]), scheme.endswith("-sym")), None, "native")
    x = torch.randn(DENSE_ROWS - 1, K, generator=g)
    lib = build.load()
    try:
        for isa in native_isas():
            lib.qb_set_isa(isa)
            alone = torch.cat([lin(x[i:i + 1]) for i in range(13)])
            for M in (2, 3, 4, 5, 7, 8, 13):
                assert torch.equal(lin(x[:M]), alone[:M]), (isa, M)
            assert torch.equal(lin(x)[:13], alone), (isa, DENSE_ROWS - 1)
    finally:
        lib.qb_set_isa(native_isas()[-1])
