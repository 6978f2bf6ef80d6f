"""W4A8 (a recipe's ``activations: int8``): every path against the integer definition in float64 (W8A8's too),
the native kernel's activation codes equal torch's, the recipe and the artifact record it, and the engine
runs it."""

import json
import os
import subprocess
import sys

import pytest
import torch

from qbench.errors import QBenchError
from qbench.kernels import build
from qbench.layers.attention import AttnMetadata
from qbench.quant.artifact import load_artifact
from qbench.quant.primitives import dequantize, fake_quantize_activations, quantize_activations, quantize_int4, \
    quantize_int8
from qbench.quant.qlinear import QuantLinear, make_qlinear
from qbench.quant.quantize import run_quantize
from qbench.quant.recipe import RecipeError, load_recipe

IMPLS = ["native", "aten", "aten-bf16", "reference"]
native = pytest.mark.skipif(not build.available(), reason="native kernels not built here")


def test_activation_codes_are_per_token_symmetric_int8():
    x = torch.tensor([[0.0, 1.0, -2.54, 2.54], [0.0, 0.0, 0.0, 0.0], [3.0, -1.5, 0.75, 1e-9]])
    codes, scale = quantize_activations(x)
    assert codes.dtype == torch.int8 and scale.shape == (3, 1)
    assert torch.allclose(scale[:, 0], torch.tensor([2.54 / 127, 1.0, 3.0 / 127]))
    assert codes[0].tolist() == [0, 50, -127, 127] and codes[1].tolist() == [0, 0, 0, 0]
    assert codes[2].tolist() == [127, -64, 32, 0]  # -63.5 and 31.75 -> nearest, ties to even
    assert torch.equal(fake_quantize_activations(x), codes.float() * scale)


def _w4a8(N, K, group, sym, seed):
    g = torch.Generator().manual_seed(seed)
    q = quantize_int4(torch.randn(N, K, generator=g), group, sym)
    q.activations = "int8"
    return q, g


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scheme", ["g32-sym", "g64-asym", "g64-sym", "g128-asym", "int8"])  # int8: W8A8
@pytest.mark.parametrize("N,K", [(48, 576), (40, 96), (200, 1536), (24, 77), (16, 130)])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 13, 259])  # 259: past DENSE_ROWS, the dense prefill path
def test_every_path_matches_the_integer_definition(impl, scheme, N, K, M):
    if impl == "native" and not build.available():
        pytest.skip("native kernels not built here")
    if scheme == "int8":
        g = torch.Generator().manual_seed(N + K + M)
        q = quantize_int8(torch.randn(N, K, generator=g))
        q.activations = "int8"
    else:
        q, g = _w4a8(N, K, int(scheme[1:].split("-")[0]), scheme.endswith("-sym"), N + K + M)
    b = torch.randn(N, generator=g)
    x = torch.randn(M, K, generator=g) * torch.linspace(0.1, 8, K)  # channels of very different size
    x[:, 3] = 40.0  # an outlier channel sets every token's scale
    codes, scale = quantize_activations(x)
    ref = (codes.double() * scale.double()) @ dequantize(q).double().t() + b.double()
    got = make_qlinear(q, b, impl)(x).double()
    # fp32 accumulation only: a code one step off moves an output by scale * |w| (~0.3 here), far past this
    tol = 2e-6 * K ** 0.5 * ref.abs().max() + 1e-5
    if impl == "aten-bf16":  # bf16 activations and scales
        tol += 2 ** -7 * (dequantize(q).double().abs() @ x.double().abs().t()).max()
    assert (got - ref).abs().max() <= tol


@pytest.mark.parametrize("scheme", ["g32-sym", "g64-asym", "g128-sym", "g128-asym", "int8"])  # int8: W8A8
@pytest.mark.parametrize("N,K", [(48, 576), (40, 96), (200, 1536), (24, 77), (16, 130), (33, 4864)])
def test_the_avx512_vnni_and_amx_tiles_equal_the_avx2_tiles_bit_for_bit(scheme, N, K):
    """The int8-activation GEMMs have AVX-512 VNNI tiles (vpdpbusd, up to 8 rows) and AMX tiles (16 x 64-byte
    tiles, four 16-row C tiles a pass) beside the AVX2 ones (4 or 6 rows): the integer sums are exact and each
    output is closed with the same float operations, so every row count gives the same bits on all three.
    (AMX takes W4A8 only where a group is whole 64-k tiles: g32 stays on VNNI, which qb_a8_route says.)"""
    if not build.available() or not build.load().qb_a8_wide():
        pytest.skip("needs a CPU with AVX-512 VNNI and VBMI")
    if scheme == "int8":
        g = torch.Generator().manual_seed(N + K)
        q = quantize_int8(torch.randn(N, K, generator=g))
        q.activations = "int8"
    else:
        q, g = _w4a8(N, K, int(scheme[1:].split("-")[0]), scheme.endswith("-sym"), N + K)
    G = 0 if scheme == "int8" else int(scheme[1:].split("-")[0])
    lin = make_qlinear(q, None, "native")
    x = torch.randn(70, K, generator=g) * torch.linspace(0.1, 8, K)
    lib = build.load()
    amx = bool(lib.qb_a8_amx())
    paths = [(256, 0, 0), (512, 0, 1)] + ([(512, 1, 2)] if amx else [])  # (isa, amx on, the route it must take)
    try:
        for M in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 40, 64, 65, 70):
            got = {}
            for isa, on, route in paths:
                lib.qb_set_isa(isa)
                lib.qb_set_amx(on)
                if route == 2 and (G % 64 or M < 16):  # AMX from 16 rows, on whole 64-k tiles per group
                    route = 1
                assert lib.qb_a8_route(M, G) == route, (M, isa, on)
                got[isa, on] = lin._matmul(x[:M].contiguous(), False)
            for key in got:
                assert torch.equal(got[key], got[256, 0]), (M, key)
    finally:
        lib.qb_set_isa(512)
        lib.qb_set_amx(1)


def test_the_int16_sums_cannot_overflow_at_the_extremes(isa):
    # every code 15 against every activation +-127 (eight k-quads per int16 sum: 8 * 2 * 15 * 127 = 30,480)
    K, N = 256, 16
    q = quantize_int4(torch.ones(N, K), 128, False)  # asymmetric over [0, 1]: codes 15, zero point 0
    assert int(q.codes.min()) == 15 and int(q.zero.max()) == 0
    q.activations = "int8"
    lin = make_qlinear(q, None, "native")
    for sign in (1.0, -1.0):
        x = torch.full((3, K), sign)
        ref = fake_quantize_activations(x).double() @ dequantize(q).double().t()
        assert torch.allclose(lin(x).double(), ref, rtol=1e-6)


def test_activations_are_fp32_or_int8(tmp_path):
    with pytest.raises(ValueError, match="activations are fp32 or int8"):
        q = quantize_int4(torch.randn(16, 32), 32)
        q.activations = "int4"
        make_qlinear(q, None, "reference")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: b\nweights: {bits: 4, group_size: 64, activations: int4}\n")
    with pytest.raises(RecipeError, match=r"bad.yaml: weights.activations: 'int4' is not supported"):
        load_recipe(str(bad))


def _logits(model, ids):
    return model(ids, AttnMetadata(positions=torch.arange(ids.shape[1]).expand(ids.shape[0], -1)))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_the_artifact_records_int8_activations_and_loads_them(tiny_models, tmp_path, family, monkeypatch):
    folder, _ = tiny_models[family]
    out = tmp_path / "art"
    manifest = run_quantize(str(folder), "w4a8g64", out, log=lambda s: None)
    schemes = {v["scheme"].get("activations") for v in manifest["quantized"].values()}
    assert schemes == {"int8"}  # the head (INT4 here) too
    model, _ = load_artifact(out)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m.activations == "int8" for m in linears)
    ids = torch.randint(2, 128, (2, 19), generator=torch.Generator().manual_seed(3))
    fast = _logits(model, ids)
    monkeypatch.setenv("QBENCH_QLINEAR", "reference")
    slow = _logits(load_artifact(out)[0], ids)
    assert (fast - slow).abs().max() < 1e-3
    # the weight-only artifact of the same weights: same codes, different numbers
    run_quantize(str(folder), "w4g64-head", tmp_path / "wo", log=lambda s: None)
    assert not torch.equal(_logits(load_artifact(tmp_path / "wo")[0], ids), slow)


def test_an_edited_activation_record_is_refused(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    out = tmp_path / "art"
    run_quantize(str(folder), "w4a8g64", out, log=lambda s: None)
    m = json.loads((out / "qbench.json").read_text())
    m["quantized"]["model.layers.0.mlp.up_proj"]["scheme"]["activations"] = "fp32"
    (out / "qbench.json").write_text(json.dumps(m))
    with pytest.raises(QBenchError, match="record different per-tensor schemes"):
        load_artifact(out)


@pytest.mark.parametrize("name", ["avx2", "avx512", "amx", "sse"])
def test_qbench_isa_forces_a_path_or_says_why_not(name):
    """QBENCH_ISA overrides the run-time dispatch; a path the CPU lacks, or an unknown name, is one clear error."""
    if not build.available():
        pytest.skip("native kernels not built here")
    code = ("from qbench.kernels import build\nfrom qbench.errors import QBenchError\n"
            "try:\n    print(build.kernel_path())\nexcept QBenchError as e:\n    print('error:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, QBENCH_ISA=name)).stdout.strip()
    lib = build.load()
    has = {"avx2": True, "avx512": lib.qb_isa() == 512, "amx": bool(lib.qb_a8_amx()), "sse": False}[name]
    if has:
        assert out == {"avx2": "avx2", "avx512": "avx512", "amx": "avx512+amx"}[name]
    elif name == "sse":
        assert out.startswith("error: QBENCH_ISA=sse: unknown; use one of auto, avx2, avx512, amx")
    else:
        assert out.startswith(f"error: QBENCH_ISA={name}: this CPU") and "unset QBENCH_ISA" in out
