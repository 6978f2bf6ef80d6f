"""FP8 weights (``type: float``, W8A16): e4m3 per output channel, widened exactly in the kernel, recorded and
verified in the artifact, exported as compressed-tensors float-quantized that transformers loads."""

import json

import pytest
import torch

from qbench.errors import QBenchError
from qbench.kernels import build
from qbench.layers.attention import AttnMetadata
from qbench.quant.artifact import load_artifact
from qbench.quant.primitives import FP8_MAX, QTensor, dequantize, quantize_fp8
from qbench.quant.qlinear import QuantLinear, make_qlinear
from qbench.quant.quantize import run_quantize
from qbench.quant.recipe import RecipeError, load_recipe

native = pytest.mark.skipif(not build.available(), reason="native kernels not built here")


def test_codes_are_e4m3_per_channel():
    w = torch.tensor([[448.0, -1.0, 0.0, 3.3], [0.0, 0.0, 0.0, 0.0], [1e-3, -2e-3, 5e-4, 0.0]])
    q = quantize_fp8(w)
    assert q.type == "float" and q.bits == 8 and q.codes.dtype == torch.uint8
    assert torch.allclose(q.scale.float(), (w.abs().amax(1) / FP8_MAX).clamp(min=1e-7).half().float())
    vals = q.codes.view(torch.float8_e4m3fn).float()
    assert vals[0].tolist() == [448.0, -1.0, 0.0, 3.25]  # 3.3 -> 3.25: two mantissa bits above 2
    assert vals.abs().max() <= FP8_MAX and not torch.isnan(vals).any()
    assert torch.equal(dequantize(q)[1], torch.zeros(4))


def _fp8(N, K, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.logspace(-3, 1, K)  # columns of very different size
    return quantize_fp8(w), g


@native
def test_every_byte_widens_exactly():
    # all 254 finite codes (0x7f and 0xff are NaN in e4m3fn: never written, refused on load)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].repeat(16, 1)  # (16, 254)
    q = QTensor(8, codes, torch.linspace(0.5, 2, 16).half(), None, None, tuple(codes.shape), type="float")
    lin = make_qlinear(q, None, "native")
    from qbench.kernels.ops import dequant_f8
    assert torch.equal(dequant_f8(lin.panels, lin.scale32, 16).t(), dequantize(q))
    # and the GEMM of the identity is the weight, exactly: all rows at once (the six-row tiles), and one and two
    # rows a call (decode's narrow tiles, which widen two k at a time), with K even and odd (the last k alone)
    assert torch.equal(lin._matmul(torch.eye(254), False).t(), dequantize(q))
    for k in (254, 253):
        lin = make_qlinear(QTensor(8, codes[:, :k].contiguous(), q.scale, None, None, (16, k), type="float"),
                           None, "native")
        eye = torch.eye(k)
        for m in (1, 2):
            rows = torch.cat([lin._matmul(eye[i:i + m], False) for i in range(0, k - m + 1, m)])
            assert torch.equal(rows.t(), dequantize(q)[:, :rows.shape[0]]), (k, m)


@pytest.mark.parametrize("impl", ["native", "aten", "reference"])
@pytest.mark.parametrize("N,K", [(48, 576), (40, 97), (24, 77), (200, 1536)])
@pytest.mark.parametrize("M", [1, 2, 3, 6, 7, 13, 259])
def test_every_path_matches_dequantize_then_matmul(impl, N, K, M):
    if impl == "native" and not build.available():
        pytest.skip("native kernels not built here")
    q, g = _fp8(N, K, N + K + M)
    b = torch.randn(N, generator=g)
    x = torch.randn(M, K, generator=g)
    Wd = dequantize(q).double()
    ref = x.double() @ Wd.t() + b.double()
    lin = make_qlinear(q, b, impl)
    assert lin.impl == ("native" if impl == "native" else "reference")  # no aten kernel for FP8 weights
    tol = 2e-6 * K ** 0.5 * (x.double().abs() @ Wd.abs().t()).max() + 1e-6
    assert (lin(x).double() - ref).abs().max() <= tol


def test_the_recipe_checks(tmp_path):
    bad = tmp_path / "bad.yaml"
    for body, msg in {
        "weights: {bits: 4, group_size: 64, type: float}": "type: float is FP8 e4m3 per output channel",
        "weights: {bits: 8, group_size: null, type: float, method: gptq}": "needs bits: 8, method: rtn",
        "weights: {bits: 8, group_size: null, type: float, activations: int8}": "activations: fp32",
        "weights: {bits: 8, group_size: null, type: fp4}": r"weights.type: 'fp4' is not supported",
    }.items():
        bad.write_text("name: b\n" + body + "\n")
        with pytest.raises(RecipeError, match=msg):
            load_recipe(str(bad))


def _logits(model, ids):
    return model(ids, AttnMetadata(positions=torch.arange(ids.shape[1]).expand(ids.shape[0], -1)))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_the_artifact_stores_f8_e4m3_and_loads_it(tiny_models, tmp_path, family, monkeypatch):
    from qbench.models.weights import read_header
    folder, _ = tiny_models[family]
    out = tmp_path / "art"
    manifest = run_quantize(str(folder), "fp8", out, log=lambda s: None)
    assert manifest["scheme"]["type"] == "float"
    assert {v["scheme"].get("type") for v in manifest["quantized"].values()} == {"float"}
    header, _ = read_header(out / "model.safetensors")
    assert {header[k + ".qweight"]["dtype"] for k in manifest["quantized"]} == {"F8_E4M3"}
    model, _ = load_artifact(out)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m.type == "float" for m in linears)
    ids = torch.randint(2, 128, (2, 19), generator=torch.Generator().manual_seed(3))
    fast = _logits(model, ids)
    monkeypatch.setenv("QBENCH_QLINEAR", "reference")
    assert (fast - _logits(load_artifact(out)[0], ids)).abs().max() < 1e-3


def _rewrite_tensor(path, name, fn):
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    t = load_file(str(path))
    t[name] = fn(t[name])
    save_file(t, str(path), metadata=meta)


def test_a_nan_code_or_a_wrong_dtype_is_refused(tiny_models, tmp_path):
    from qbench.paths import sha256_file
    folder, _ = tiny_models["llama"]
    name = "model.layers.0.mlp.up_proj.qweight"
    for what, fn, msg in [
        ("nan", lambda t: t.view(torch.uint8).index_fill(1, torch.tensor([3]), 0x7F).view(torch.float8_e4m3fn),
         "NaN or infinite"),
        ("dtype", lambda t: t.view(torch.uint8), "the manifest says float 8-bit"),
    ]:
        out = tmp_path / what
        run_quantize(str(folder), "fp8", out, log=lambda s: None)
        _rewrite_tensor(out / "model.safetensors", name, fn)
        m = json.loads((out / "qbench.json").read_text())  # the file hash updated: only the content check is left
        m["files_sha256"]["model.safetensors"] = sha256_file(out / "model.safetensors")
        (out / "qbench.json").write_text(json.dumps(m))
        with pytest.raises(QBenchError, match=msg):
            load_artifact(out)


def test_transformers_loads_the_float_quantized_export(tiny_models, tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM
    from qbench.quant.export import run_export
    folder, _ = tiny_models["llama"]
    run_quantize(str(folder), "fp8", tmp_path / "art", log=lambda s: None)
    run_export(tmp_path / "art", "compressed-tensors", tmp_path / "ct")
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "float-quantized"
    assert [g["weights"]["type"] for g in cfg["config_groups"].values()] == ["float"]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ct"), dtype=torch.float32).eval()
    ids = torch.randint(2, 128, (2, 15), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    got = _logits(load_artifact(tmp_path / "art")[0], ids)
    assert (got - ref).abs().max() < 1e-3 and torch.equal(got.argmax(-1), ref.argmax(-1))


def test_an_export_mixing_fp8_and_integer_weights_is_refused(tiny_models, tmp_path):
    from qbench.quant.export import run_export
    folder, _ = tiny_models["llama"]
    (tmp_path / "r.yaml").write_text("name: m\nweights: {bits: 8, group_size: null, type: float, lm_head: {bits: 8}}\n")
    run_quantize(str(folder), str(tmp_path / "r.yaml"), tmp_path / "art", log=lambda s: None)
    with pytest.raises(QBenchError, match="mixes FP8 and integer weights"):
        run_export(tmp_path / "art", "compressed-tensors", tmp_path / "ct")
    assert not (tmp_path / "ct").exists()
