"""W8A8 (INT8 weights with a recipe's ``activations: int8``): the native kernel equals the integer definition
bit for bit, every path matches it, the artifact records it, and the engine runs it."""

import pytest
import torch

from qbench.engine.engine import Engine
from qbench.engine.sampling import SamplingParams
from qbench.kernels import build
from qbench.quant.artifact import load_artifact
from qbench.quant.primitives import quantize_activations, quantize_fp8, quantize_int4, quantize_int8
from qbench.quant.qlinear import QuantLinear, make_qlinear
from qbench.quant.quantize import run_quantize
from qbench.quant.recipe import load_recipe

native = pytest.mark.skipif(not build.available(), reason="native kernels not built here")


def _w8a8(N, K, seed):
    g = torch.Generator().manual_seed(seed)
    q = quantize_int8(torch.randn(N, K, generator=g))
    q.activations = "int8"
    return q, g


def _inputs(M, K, g):
    x = torch.randn(M, K, generator=g) * torch.linspace(0.1, 8, K)  # channels of very different size
    x[:, min(3, K - 1)] = 40.0  # an outlier channel sets every token's scale
    return x


def integer_definition(x: torch.Tensor, q) -> torch.Tensor:
    """The exact integer sums (int64) of activation and weight codes, then float(sum) * (s_w * s_x) in fp32."""
    codes, sx = quantize_activations(x)
    sums = codes.long() @ q.codes.long().t()  # (M, N), exact
    return sums.float() * (q.scale.float()[None, :] * sx)


@pytest.mark.parametrize("N,K", [(48, 576), (40, 97), (200, 1536), (24, 77), (16, 130), (33, 4864), (17, 1)])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 6, 7, 8, 9, 13, 17, 64, 259])
def test_the_kernel_is_the_integer_definition_bit_for_bit(N, K, M, isa):
    # int32 sums are exact and the kernel rounds float(sum) * (s_w * s_x) in that order: nothing is left to
    # tolerance, on the AVX2 tiles and on the AVX-512 VNNI ones (vpdpbusd with its +128 correction, a masked
    # last k-quad for K % 4 != 0). 259 rows: prefill sizes take this kernel too (but on an AVX-512 CPU without
    # VBMI, whose oneDNN fp32 GEMM is faster than the AVX2 tiles)
    q, g = _w8a8(N, K, N * K + M)
    x = _inputs(M, K, g)
    lin = make_qlinear(q, None, "native")
    assert torch.equal(lin._matmul(x, False), integer_definition(x, q))


def test_the_int32_sums_at_the_extremes(isa):
    # every weight code +-127 against every activation +-127 over 4,864 k: |sum| = 78.4 M, exact in int32
    K = 4864
    q = quantize_int8(torch.cat([torch.ones(8, K), -torch.ones(8, K)]))
    assert int(q.codes.abs().min()) == 127
    q.activations = "int8"
    lin = make_qlinear(q, None, "native")
    for sign in (1.0, -1.0):
        x = torch.full((3, K), sign)
        assert torch.equal(lin._matmul(x, False), integer_definition(x, q))
        assert lin._matmul(x, False)[0, 0].item() == pytest.approx(sign * K, rel=1e-3)  # fp16 scale of 1 / 127


@native
@pytest.mark.parametrize("fmt", ["w4a8-g32", "w4a8-g64-asym", "w4a8-g128", "w8a8", "fp8"])
def test_a_rows_result_does_not_depend_on_its_batch(fmt):
    # tiles of one to six rows close every row with the same float operations, in the same order
    g = torch.Generator().manual_seed(len(fmt))
    w = torch.randn(40, 300, generator=g)
    if fmt == "fp8":
        q = quantize_fp8(w)
    elif fmt == "w8a8":
        q = quantize_int8(w)
    else:
        q = quantize_int4(w, int(fmt.split("-")[1][1:]), not fmt.endswith("asym"))
    q.activations = "fp32" if fmt == "fp8" else "int8"
    lin = make_qlinear(q, None, "native")
    x = torch.randn(13, 300, generator=g)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(13)])
    for M in range(2, 14):
        assert torch.equal(lin(x[:M]), alone[:M])


def test_int8_activations_change_the_numbers_of_int8_weights():
    q, g = _w8a8(32, 64, 1)
    x = _inputs(4, 64, g)
    wo = type(q)(8, q.codes, q.scale, None, None, q.shape)  # the same codes, fp32 activations
    assert not torch.equal(make_qlinear(q, None, "reference")(x), make_qlinear(wo, None, "reference")(x))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_the_artifact_records_int8_activations_and_loads_them(tiny_models, tmp_path, family, monkeypatch):
    folder, _ = tiny_models[family]
    out = tmp_path / "art"
    manifest = run_quantize(str(folder), "w8a8", out, log=lambda s: None)
    assert {(v["scheme"]["bits"], v["scheme"].get("activations")) for v in manifest["quantized"].values()} == \
        {(8, "int8")}
    model, _ = load_artifact(out)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m.activations == "int8" and m.bits == 8 for m in linears)
    ids = torch.randint(2, 128, (2, 19), generator=torch.Generator().manual_seed(3))
    from qbench.layers.attention import AttnMetadata
    meta = AttnMetadata(positions=torch.arange(19).expand(2, -1))
    fast = model(ids, meta)
    monkeypatch.setenv("QBENCH_QLINEAR", "reference")
    slow = load_artifact(out)[0](ids, meta)
    # the paths differ in fp32 rounding only, but a difference that lands an activation on the other side of a
    # rounding boundary moves its code by one, the outputs downstream by about s_x * |w| (~0.01 here), and
    # through attention every later position: the linears are held to the integer definition above, one by one
    assert (fast - slow).abs().max() < 0.05
    from qbench.models.registry import load_model
    from qbench.quant.apply import quantize_model
    monkeypatch.delenv("QBENCH_QLINEAR")
    inproc = load_model(folder)
    quantize_model(inproc, load_recipe("w8a8"), None, log=lambda *a: None)
    assert torch.equal(inproc(ids, meta), fast)  # what was written is what was quantized
    run_quantize(str(folder), "w8", tmp_path / "wo", log=lambda s: None)  # the same codes, fp32 inputs
    assert not torch.equal(load_artifact(tmp_path / "wo")[0](ids, meta), slow)


@pytest.mark.parametrize("recipe", ["w4a8g64", "w8a8", "fp8"])
def test_batched_equals_sequential(tiny_models, recipe):
    # every format of issue 19: per-token activation scales and FP8 widening keep a row's numbers its own
    folder, _ = tiny_models["qwen2"]
    from qbench.models.registry import load_model
    from qbench.quant.apply import quantize_model
    model = load_model(folder)
    quantize_model(model, load_recipe(recipe), None, log=lambda *a: None)
    prompts = [[5, 6, 7], list(range(10, 30)), list(range(40, 49))]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    together = [s.output_ids for s in Engine(model, block_size=4).generate(prompts, params)]
    alone = [Engine(model, block_size=4).generate([p], params)[0].output_ids for p in prompts]
    assert together == alone
