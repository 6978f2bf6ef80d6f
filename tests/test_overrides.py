"""Per-linear overrides in a recipe: parsing and errors, resolution, and mixed artifacts end to end."""

import pytest
import torch

from qbench.errors import QBenchError
from qbench.layers.attention import AttnMetadata
from qbench.quant.artifact import load_artifact
from qbench.quant.qlinear import QuantLinear
from qbench.quant.quantize import run_quantize
from qbench.quant.recipe import RecipeError, load_recipe

MIXED = """name: mixed
weights:
  bits: 4
  group_size: 64
  overrides:
    - {match: "blocks.0.*", bits: 8}
    - {match: "*.down_proj", group_size: 32}
    - {match: "blocks.1.down_proj", symmetric: false}
    - {match: "blocks.1.o_proj", fp: true}
"""


def recipe_file(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_overrides_resolve_against_the_base_scheme_and_the_last_match_wins(tmp_path):
    ws = load_recipe(recipe_file(tmp_path, MIXED)).weights
    assert ws.linear_scheme("blocks.0.qkv") == (8, None, True, "int")
    assert ws.linear_scheme("blocks.0.down_proj") == (4, 32, True, "int")  # the later match, against the base
    assert ws.linear_scheme("blocks.1.down_proj") == (4, 64, False, "int")  # not chained onto the group-32 one
    assert ws.linear_scheme("blocks.1.o_proj") is None
    assert ws.linear_scheme("blocks.1.qkv") == (4, 64, True, "int")
    assert ws.linear_scheme("blocks.10.qkv") == (4, 64, True, "int")  # blocks.1.* would not reach block 10


@pytest.mark.parametrize("overrides,fragment", [
    ("[{match: x, bits: 3}]", "weights.overrides[0].bits: 3 is not supported"),
    ("[{match: x, bits: 4}]", None),  # from INT8: the group must be given
    ("[{match: x, grop_size: 32}]", "unknown key weights.overrides[0].grop_size"),
    ("[{match: x, fp: true, bits: 8}]", "weights.overrides[0]: fp: true keeps"),
    ("[{bits: 8}]", "weights.overrides[0].match"),
    ("{match: x}", "weights.overrides: must be a list"),
    ("[{match: x, group_size: 96}]", "weights.overrides[0].group_size: 96 is not supported"),
    ("[{match: x, symmetric: maybe}]", "weights.overrides[0].symmetric"),
    ("[{match: x, activations: int4}]", "weights.overrides[0].activations: 'int4' is not supported"),
    ("[{match: x, fp: true, activations: fp32}]", "weights.overrides[0]: fp: true keeps"),
])
def test_bad_overrides_name_the_file_and_field(tmp_path, overrides, fragment):
    base = "{bits: 8, group_size: null}" if fragment is None else "{bits: 4, group_size: 64}"
    text = f"name: r\nweights: {base[:-1]}, overrides: {overrides}}}\n"
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file(tmp_path, text))
    msg = str(e.value)
    assert msg.startswith(str(tmp_path / "r.yaml") + ": ")
    assert (fragment or "weights.overrides[0].group_size: None is not supported") in msg


def test_an_override_on_an_fp8_base_and_an_unfit_activation_scheme_are_refused(tmp_path):
    fp8 = "name: r\nweights: {bits: 8, group_size: null, type: float, overrides: [{match: x, bits: 4, group_size: 64}]}\n"
    with pytest.raises(RecipeError, match="weights.overrides.0.: the base scheme is FP8"):
        load_recipe(recipe_file(tmp_path, fp8))


def test_an_override_sets_its_linears_activations_apart_from_the_base(tmp_path):
    text = ("name: r\nweights: {bits: 8, group_size: null, activations: int8, overrides: "
            "[{match: '*.down_proj', activations: fp32}, {match: 'blocks.0.*', bits: 4, group_size: 64}]}\n")
    ws = load_recipe(recipe_file(tmp_path, text)).weights
    assert ws.linear_activations("blocks.1.down_proj") == "fp32"
    assert ws.linear_activations("blocks.1.gate_up") == "int8"
    # the last match wins whole, against the base: blocks.0.down_proj meets the base's int8 inputs
    assert ws.linear_activations("blocks.0.down_proj") == "int8"
    assert ws.linear_scheme("blocks.0.down_proj") == (4, 64, True, "int")


def logits(model, ids):
    return model(ids, AttnMetadata(positions=torch.arange(ids.shape[1]).expand(ids.shape[0], -1)))


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_a_mixed_artifact_records_each_tensors_scheme_and_runs_as_the_reference_path(tiny_models, tmp_path,
                                                                                       method, monkeypatch):
    folder, _ = tiny_models["llama"]
    text = MIXED.replace("group_size: 64\n", f"group_size: 64\n  method: {method}\n")
    if method == "gptq":
        text += "calibration: {samples: 2, seq_len: 16}\n"
        import qbench.quant.quantize as qz
        monkeypatch.setattr(qz, "calibration_windows", lambda tok, cal: (
            torch.randint(2, 128, (cal.samples, cal.seq_len), generator=torch.Generator().manual_seed(0)), {}))
        monkeypatch.setattr("qbench.engine.api.load_tokenizer", lambda folder: None)
    m = run_quantize(str(folder), recipe_file(tmp_path, text), tmp_path / "a", log=lambda s: None)
    q = m["quantized"]
    assert q["model.layers.0.self_attn.q_proj"]["scheme"] == {"bits": 8, "group_size": None, "symmetric": True}
    assert q["model.layers.0.mlp.down_proj"]["scheme"] == {"bits": 4, "group_size": 32, "symmetric": True}
    assert q["model.layers.1.mlp.down_proj"]["scheme"] == {"bits": 4, "group_size": 64, "symmetric": False}
    assert q["model.layers.1.mlp.gate_proj"]["scheme"] == {"bits": 4, "group_size": 64, "symmetric": True}
    assert "model.layers.1.self_attn.o_proj" not in q
    assert m["fp_linears"] == ["blocks.1.o_proj", "lm_head"]
    model, _ = load_artifact(tmp_path / "a")
    assert not isinstance(model.blocks[1].o_proj, QuantLinear) and isinstance(model.blocks[0].o_proj, QuantLinear)
    ids = torch.randint(2, 128, (2, 17), generator=torch.Generator().manual_seed(3))
    fast = logits(model, ids)
    monkeypatch.setenv("QBENCH_QLINEAR", "reference")  # dequantize-then-matmul, the golden path
    assert (fast - logits(load_artifact(tmp_path / "a")[0], ids)).abs().max() < 1e-3


def test_w8a8_with_fp32_inputs_for_down_proj_skips_its_smoothing_and_runs_as_the_reference_path(
        tiny_models, tmp_path, monkeypatch):
    folder, _ = tiny_models["llama"]
    text = ("name: mix\nweights: {bits: 8, group_size: null, activations: int8, "
            "overrides: [{match: '*.down_proj', activations: fp32}]}\n"
            "smoothquant: {alpha: 0.5}\ncalibration: {samples: 2, seq_len: 16}\n")
    import qbench.quant.quantize as qz
    monkeypatch.setattr(qz, "calibration_windows", lambda tok, cal: (
        torch.randint(2, 128, (cal.samples, cal.seq_len), generator=torch.Generator().manual_seed(0)), {}))
    monkeypatch.setattr("qbench.engine.api.load_tokenizer", lambda folder: None)
    m = run_quantize(str(folder), recipe_file(tmp_path, text), tmp_path / "a", log=lambda s: None)
    q = m["quantized"]
    assert "activations" not in q["model.layers.0.mlp.down_proj"]["scheme"]  # fp32, the default, not recorded
    assert q["model.layers.0.mlp.up_proj"]["scheme"]["activations"] == "int8"
    assert q["model.layers.1.self_attn.o_proj"]["scheme"]["activations"] == "int8"
    smoothed = {r["smoothquant"]["smooth"] for r in m["layers"] if "smoothquant" in r}
    assert smoothed == {"input_norm", "post_norm", "v"}  # not up -> down: down_proj meets fp32 inputs
    model, _ = load_artifact(tmp_path / "a")
    assert model.blocks[0].down_proj.activations == "fp32" and model.blocks[0].gate_up.activations == "int8"
    ids = torch.randint(2, 128, (2, 17), generator=torch.Generator().manual_seed(3))
    fast = logits(model, ids)
    monkeypatch.setenv("QBENCH_QLINEAR", "reference")
    assert (fast - logits(load_artifact(tmp_path / "a")[0], ids)).abs().max() < 1e-3


def test_a_pattern_that_matches_no_linear_is_refused_before_any_work(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    text = "name: r\nweights: {bits: 4, group_size: 64, overrides: [{match: 'layers.0.*', bits: 8}]}\n"
    with pytest.raises(QBenchError, match=r"weights.overrides\[0\].match: 'layers.0.\*' matches no linear .*blocks.0.qkv"):
        run_quantize(str(folder), recipe_file(tmp_path, text), tmp_path / "a", log=lambda s: None)
    assert not (tmp_path / "a").exists()


def test_tensor_parallel_refuses_a_mixed_artifact_with_one_line(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    run_quantize(str(folder), recipe_file(tmp_path, MIXED), tmp_path / "a", log=lambda s: None)
    with pytest.raises(QBenchError, match="tensor parallel: .* mixes weight schemes"):
        load_artifact(tmp_path / "a", torch.float32, shard=lambda cfg, t, scheme: (cfg, t))
    one = "name: one\nweights: {bits: 4, group_size: 64, overrides: [{match: blocks.1.o_proj, fp: true}]}\n"
    run_quantize(str(folder), recipe_file(tmp_path, one, "one.yaml"), tmp_path / "b", log=lambda s: None)
    load_artifact(tmp_path / "b", torch.float32, shard=lambda cfg, t, scheme: (cfg, t))  # one scheme: accepted
