"""The online Hadamard rotation of a linear's inputs (quant/hadamard.py, ``weights.hadamard``): the transform
against the explicit matrix, the C butterflies against torch's to the bit, the rotated weights against the
unrotated product, and rotated artifacts end to end (calibrated or not, every linear path, the one-call
decode step, the manifest, the recipe's and the export's refusals)."""

import json

import pytest
import torch

from qbench.errors import QBenchError
from qbench.kernels import build
from qbench.layers.attention import AttnMetadata
from qbench.models.registry import load_model
from qbench.quant import hadamard
from qbench.quant.apply import quantize_model
from qbench.quant.qlinear import QuantLinear
from qbench.quant.recipe import RecipeError, load_recipe

IDS = torch.randint(2, 128, (2, 17), generator=torch.Generator().manual_seed(5))


def _sylvester(b: int) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < b:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)])
    return H


def _logits(model, ids=IDS):
    return model(ids, AttnMetadata(positions=torch.arange(ids.shape[1]).expand(ids.shape[0], -1)))


def _recipe(tmp_path, weights: str, extra: str = "", name="r.yaml"):
    p = tmp_path / name
    p.write_text(f"name: r\nweights: {weights}\n{extra}")
    return str(p)


ROT_W8A8 = ("{bits: 8, group_size: null, activations: int8, method: rtn, "
            "overrides: [{match: '*.down_proj', hadamard: true}]}")


@pytest.mark.parametrize("b", [16, 32, 512])
def test_fwht_is_the_block_diagonal_sylvester_product(b):
    x = torch.randn(3, 5, 3 * b, dtype=torch.float64)
    R = torch.block_diag(*[_sylvester(b)] * 3)
    torch.testing.assert_close(hadamard.fwht(x, b), x @ R, rtol=0, atol=1e-12)
    torch.testing.assert_close(hadamard.fwht(hadamard.fwht(x, b), b), b * x, rtol=0, atol=1e-11)  # H H = b I


def test_the_block_is_the_largest_power_of_two_dividing_the_inputs():
    assert hadamard.block_for(1536) == 512  # SmolLM2's down_proj: 3 x 512
    assert hadamard.block_for(4864) == 256  # Qwen2.5-0.5B's: 19 x 256
    assert hadamard.block_for(8192) == 512  # capped
    assert hadamard.block_for(96) == 32
    assert hadamard.block_for(24) == 0 and hadamard.block_for(7) == 0  # under 16: no rotation


@pytest.mark.parametrize("b", [16, 64, 256])
def test_the_rotated_weight_meets_the_rotated_input_in_the_same_product(b):
    g = torch.Generator().manual_seed(0)
    x, W = torch.randn(9, 2 * b, generator=g, dtype=torch.float64), torch.randn(5, 2 * b, generator=g, dtype=torch.float64)
    xr, Wr = hadamard.fwht(x, b), hadamard.rotate_weight(W, b)
    torch.testing.assert_close(xr @ Wr.t(), x @ W.t(), rtol=0, atol=1e-12)
    torch.testing.assert_close(hadamard.rotate_hessian(x.t() @ x, b), xr.t() @ xr, rtol=1e-12, atol=1e-9)


@pytest.mark.skipif(not build.available(), reason="native kernels not built here")
@pytest.mark.parametrize("isa", [256, 512])
@pytest.mark.parametrize("rows,K,b", [(1, 16, 16), (3, 96, 32), (5, 1536, 512), (8, 4864, 256), (2, 64, 64)])
def test_the_c_butterflies_give_torchs_bits(rows, K, b, isa):
    from qbench.kernels import ops
    lib = build.load()
    if isa == 512 and lib.qb_isa() < 512:
        pytest.skip("no AVX-512 here")
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(K)) * 30
    y = x.clone()
    lib.qb_set_isa(isa)
    try:
        ops.fwht_(y, b)
    finally:
        lib.qb_set_isa(0)
    assert torch.equal(y, hadamard.fwht(x, b))


def test_the_recipe_says_which_linears_rotate(tmp_path):
    ws = load_recipe(_recipe(tmp_path, ROT_W8A8)).weights
    assert ws.linear_hadamard("blocks.3.down_proj") and not ws.linear_hadamard("blocks.3.qkv")
    assert load_recipe("w8a8-sq-had").weights.linear_hadamard("blocks.0.down_proj")
    everything = load_recipe(_recipe(tmp_path, "{bits: 8, group_size: null, hadamard: true, "
                                                "overrides: [{match: '*.qkv', hadamard: false}]}")).weights
    assert everything.linear_hadamard("blocks.0.o_proj") and not everything.linear_hadamard("blocks.0.qkv")


@pytest.mark.parametrize("weights,fragment", [
    ("{bits: 8, group_size: null, overrides: [{match: x, hadamard: yes please}]}", "overrides[0].hadamard"),
    ("{bits: 8, group_size: null, hadamard: 512}", "weights.hadamard: 512"),
    ("{bits: 8, group_size: null, overrides: [{match: x, fp: true, hadamard: true}]}", "fp: true keeps"),
    ("{bits: 4, group_size: 64, method: awq, hadamard: true}", "weights.hadamard: the rotation takes"),
    ("{bits: 8, group_size: null, type: float, hadamard: true}", "weights.hadamard: the rotation takes"),
])
def test_bad_rotations_name_the_file_and_field(tmp_path, weights, fragment):
    with pytest.raises(RecipeError) as e:
        load_recipe(_recipe(tmp_path, weights))
    assert str(e.value).startswith(str(tmp_path / "r.yaml") + ": ") and fragment in str(e.value)


def test_a_width_without_a_block_is_refused_before_any_work(tiny_models, tmp_path, monkeypatch):
    model = load_model(tiny_models["llama"][0])
    recipe = load_recipe(_recipe(tmp_path, "{bits: 8, group_size: null, overrides: [{match: '*.down_proj', "
                                           "hadamard: true}]}"))
    monkeypatch.setattr(hadamard, "MIN_BLOCK", 64)  # the tiny down_proj's 96 = 3 x 32 inputs then have no block
    with pytest.raises(QBenchError, match="blocks.0.down_proj has 96 inputs"):
        quantize_model(model, recipe, None, log=lambda *a: None)


@pytest.mark.parametrize("weights", [
    "{bits: 8, group_size: null, hadamard: true}",  # every decoder linear, fp32 inputs
    "{bits: 4, group_size: 32, hadamard: true}",
    ROT_W8A8,
    "{bits: 4, group_size: 32, activations: int8, overrides: [{match: '*.down_proj', hadamard: true}]}",
])
@pytest.mark.parametrize("impl", ["native", "reference", "aten"])
def test_a_rotated_linear_computes_x_w_on_every_path(tiny_models, tmp_path, weights, impl, monkeypatch):
    """Every path rotates the inputs before they meet W H / b: the rotated model stays as close to the fp model
    as the same scheme unrotated (a path that forgot the rotation would be far off), and every path gives the
    reference path's numbers."""
    monkeypatch.setenv("QBENCH_QLINEAR", impl)
    if impl == "native" and not build.available():
        pytest.skip("native kernels not built here")
    fp = load_model(tiny_models["llama"][0])
    ref = _logits(fp)
    plain = load_model(tiny_models["llama"][0])
    quantize_model(plain, load_recipe(_recipe(tmp_path, weights.replace("hadamard: true", "hadamard: false"),
                                              name="p.yaml")), None, log=lambda *a: None)
    model = load_model(tiny_models["llama"][0])
    quantize_model(model, load_recipe(_recipe(tmp_path, weights)), None, log=lambda *a: None)
    rotated = [m for m in model.modules() if isinstance(m, QuantLinear) and m.hadamard]
    assert rotated and all(m.hadamard == (32 if m.in_features == 96 else 64) for m in rotated)
    got = _logits(model)
    err, err_plain = (got - ref).abs().max().item(), (_logits(plain) - ref).abs().max().item()
    assert err < 3 * err_plain + 1e-3, (err, err_plain)


@pytest.mark.parametrize("scheme", ["w8", "w4g32", "w8a8", "w4a8g32"])
@pytest.mark.parametrize("impl", ["native", "reference", "aten"])
def test_every_path_rotates_then_runs_its_unrotated_product(scheme, impl):
    """A rotated linear on x gives, bit for bit, the same linear unrotated on fwht(x): the rotation is the only
    thing added, on every path (the native one through qb_fwht)."""
    from dataclasses import replace

    from qbench.quant.primitives import quantize_int4, quantize_int8
    from qbench.quant.qlinear import make_qlinear
    if impl == "native" and not build.available():
        pytest.skip("native kernels not built here")
    g = torch.Generator().manual_seed(1)
    W, bias = torch.randn(40, 192, generator=g), torch.randn(40, generator=g)
    q = quantize_int8(W) if scheme.startswith("w8") else quantize_int4(W, 32, True)
    q.activations = "int8" if "a8" in scheme else "fp32"
    x = torch.randn(2, 7, 192, generator=g) * 5
    x[..., 3] *= 40  # an outlier channel
    before = x.clone()
    got = make_qlinear(replace(q, hadamard=64), bias, impl)(x)
    assert torch.equal(x, before)  # the caller's input is left alone
    assert torch.equal(got, make_qlinear(q, bias, impl)(hadamard.fwht(x, 64)))


def test_the_artifact_records_the_rotation_and_refuses_a_damaged_one(tiny_models, tmp_path):
    from qbench.quant.artifact import load_artifact
    from qbench.quant.export import run_export
    from qbench.quant.quantize import run_quantize
    out = tmp_path / "art"
    run_quantize(str(tiny_models["qwen2"][0]), _recipe(tmp_path, ROT_W8A8), out, log=lambda s: None)
    manifest = json.loads((out / "qbench.json").read_text())
    schemes = {n: i.get("scheme", {}) for n, i in manifest["quantized"].items()}
    assert {n for n, s in schemes.items() if s.get("hadamard")} == {
        n for n in schemes if "down_proj" in n} and all(s.get("hadamard") in (None, 32) for s in schemes.values())
    model = load_model(tiny_models["qwen2"][0])
    quantize_model(model, load_recipe(_recipe(tmp_path, ROT_W8A8)), None, log=lambda *a: None)
    loaded, _ = load_artifact(out)
    assert torch.equal(_logits(loaded), _logits(model))
    with pytest.raises(QBenchError, match="Hadamard transform"):
        run_export(out, "compressed-tensors", tmp_path / "ct")
    name = next(n for n in schemes if "down_proj" in n)
    manifest["quantized"][name]["scheme"]["hadamard"] = 24
    (out / "qbench.json").write_text(json.dumps(manifest))
    with pytest.raises(QBenchError, match="record different per-tensor schemes"):  # the tensors' own record
        load_artifact(out)


@pytest.mark.parametrize("recipe", ["w8a8-sq-had", "gptq"])
def test_a_calibrated_rotation_is_what_the_engine_runs(tiny_models, tmp_path, recipe):
    """SmoothQuant leaves a rotated down_proj unsmoothed (its up rows keep their values); GPTQ quantizes W H / b
    against the rotated Hessian; the widened block that feeds the next block computes what the quantized model
    does, so the in-process model equals its own reload and stays close to fp."""
    calib = torch.randint(2, 128, (2, 32), generator=torch.Generator().manual_seed(4))
    gptq = "{bits: 4, group_size: 32, method: gptq, overrides: [{match: '*.down_proj', hadamard: %s}]}"
    spec = "w8a8-sq-had" if recipe == "w8a8-sq-had" else _recipe(tmp_path, gptq % "true")
    plain = "w8a8-sq" if recipe == "w8a8-sq-had" else _recipe(tmp_path, gptq % "false", name="p.yaml")
    fp = load_model(tiny_models["llama"][0])
    unrotated = load_model(tiny_models["llama"][0])
    quantize_model(unrotated, load_recipe(plain), calib, log=lambda *a: None)
    model = load_model(tiny_models["llama"][0])
    res = quantize_model(model, load_recipe(spec), calib, log=lambda *a: None)
    mods = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert all(bool(m.hadamard) == n.endswith("down_proj") for n, m in mods.items())
    smoothed = {tuple(r["smoothquant"]["balance"]) for r in res.layers if "smoothquant" in r}
    assert ("down_proj",) not in smoothed
    if recipe == "w8a8-sq-had":
        assert ("qkv",) in smoothed and ("gate_up",) in smoothed
    errs = [r for r in res.layers if r.get("module", "").endswith("down_proj") and "output_rel_error" in r]
    assert errs and all(r["output_rel_error"] < 0.2 for r in errs)
    ref = _logits(fp)
    err, err_plain = (_logits(model) - ref).abs().max().item(), (_logits(unrotated) - ref).abs().max().item()
    assert err < 2 * err_plain, (err, err_plain)  # a rotation the calibration or the engine missed: far off


ROTATED = {"w8a8-down": ROT_W8A8, "w8-all": "{bits: 8, group_size: null, hadamard: true}",
           "w4a8g32-down": "{bits: 4, group_size: 32, activations: int8, "
                           "overrides: [{match: '*.down_proj', hadamard: true}]}"}


@pytest.mark.skipif(not build.available(), reason="native kernels not built here")
@pytest.mark.parametrize("kv", [None, "k4v4"])
@pytest.mark.parametrize("weights", sorted(ROTATED))
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_one_call_step_rotates_as_the_layer_by_layer_step(tiny_models, tmp_path, family, weights, kv,
                                                              monkeypatch):
    from test_fused_decode import UNEVEN, _decode_logits, _recorded_decode

    from qbench.layers.kvscheme import KVScheme
    kv = None if kv is None else KVScheme(4, 4, v_group=16, residual=48)
    model = load_model(tiny_models[family][0])
    quantize_model(model, load_recipe(_recipe(tmp_path, ROTATED[weights])), None, log=lambda *a: None)
    logits = {}
    for fused in (False, True):
        _, ran, _, logits[fused] = _recorded_decode(model, kv, monkeypatch, fused)
        assert ran == ([True] * 19 if fused else [])
    assert all(torch.equal(a, b) for a, b in zip(logits[False], logits[True])) and len(logits[True]) == 19
    batched, _, _ = _decode_logits(model, kv, monkeypatch, True, steps=12)
    assert batched == [_decode_logits(model, kv, monkeypatch, True, [p], steps=12)[0][0] for p in UNEVEN]


@pytest.mark.parametrize("acts", ["fp32", "int8"])
def test_the_widened_linear_computes_what_the_rotated_linear_does(acts):
    """During calibration a quantized, rotated linear's widened copy feeds the next block: it must rotate too."""
    from dataclasses import replace

    from qbench.quant.primitives import quantize_int8
    from qbench.quant.qlinear import make_qlinear
    from qbench.quant.wide import WideLinear
    g = torch.Generator().manual_seed(2)
    W, x = torch.randn(24, 128, generator=g), torch.randn(5, 128, generator=g)
    x[:, 7] *= 50
    q = replace(quantize_int8(hadamard.rotate_weight(W, 64)), activations=acts, hadamard=64)
    wide = WideLinear(W, None)
    wide.quantized(q)
    want = make_qlinear(q, None, "reference")(x)
    torch.testing.assert_close(wide(x.double()).float(), want, rtol=1e-5, atol=1e-4)
    exact = x @ W.t()
    assert ((want - exact).norm() / exact.norm()).item() < 0.02  # and that is close to x W^T


def test_tensor_parallel_refuses_a_rotated_artifact_with_one_line(tiny_models, tmp_path):
    """Every linear rotated is one scheme, which tensor parallelism would otherwise take: a rank's slice of a
    row-parallel input (SmolLM2's down_proj: 768 of 1,536 on 2 ranks) need not hold whole blocks of 512."""
    from qbench.quant.artifact import load_artifact
    from qbench.quant.quantize import run_quantize
    run_quantize(str(tiny_models["llama"][0]), _recipe(tmp_path, "{bits: 8, group_size: null, hadamard: true}"),
                 tmp_path / "a", log=lambda s: None)
    with pytest.raises(QBenchError, match="tensor parallel: .* rotates the inputs of model.layers.0.* online .weights.hadamard"):
        load_artifact(tmp_path / "a", torch.float32, shard=lambda cfg, t, scheme: (cfg, t))
    load_artifact(tmp_path / "a", torch.float32)  # one process: accepted
