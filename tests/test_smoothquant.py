"""SmoothQuant: the scales' formula, folding leaves the fp model unchanged, smoothing lowers the W8A8 error
where activations have outlier channels, the alpha search, and the recipe's checks."""

import pytest
import torch

from qbench.errors import QBenchError
from qbench.layers.attention import AttnMetadata
from qbench.quant import smoothing
from qbench.quant.apply import quantize_model
from qbench.quant.passes import capture
from qbench.quant.recipe import RecipeError, load_recipe


def test_the_scales_are_max_x_to_alpha_over_max_w_to_one_minus_alpha():
    x_max = torch.tensor([4.0, 1.0, 0.0, 9.0])
    W = torch.tensor([[1.0, -0.25, 2.0, 0.0], [-2.0, 0.5, 1.0, 0.0]])  # max |W| per column: 2, 0.5, 2, 0
    s = smoothing.smoothquant_scales(x_max, W, 0.5)
    assert torch.allclose(s[:2], torch.tensor([(4 / 2) ** 0.5, (1 / 0.5) ** 0.5]))
    assert s[2] == 1 and s[3] == 1  # a channel that never fires, a column of zero weights: left alone
    assert torch.allclose(smoothing.smoothquant_scales(x_max, W, 1.0)[:2], x_max[:2])
    assert torch.allclose(smoothing.smoothquant_scales(x_max, W, 0.0)[:2], 1 / torch.tensor([2.0, 0.5]))


def _model(tiny_models, family="llama"):
    from qbench.models.registry import load_model
    folder, _ = tiny_models[family]
    return load_model(folder)


def _logits(model, ids):
    return model(ids, AttnMetadata(positions=torch.arange(ids.shape[1]).expand(ids.shape[0], -1)))


IDS = torch.randint(2, 128, (2, 17), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_folding_leaves_the_fp_model_unchanged(tiny_models, family):
    model = _model(tiny_models, family)
    before = _logits(model, IDS)
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    assert cfg.num_kv_heads < cfg.num_heads  # grouped-query: v -> o scales are tied over a group
    for block in model.blocks:
        for smooth, balance, _ in smoothing.mappings(cfg, shared_v=True):
            k = block.get_submodule(balance[0]).weight.shape[1]
            s = torch.rand(k, generator=g) * 4 + 0.25
            if smooth == "v":
                s = smoothing.tie_groups(s, cfg.num_kv_heads, cfg.head_dim)
                with pytest.raises(ValueError, match="shared by the query heads"):
                    smoothing.fold(block, smooth, balance, torch.rand(k, generator=g) + 1)
            smoothing.fold(block, smooth, balance, s)
    assert torch.allclose(_logits(model, IDS), before, atol=1e-4, rtol=1e-4)


def _outlier_model(tiny_models):
    """The tiny Llama with a few input channels of every RMSNorm made 30x larger: the outliers SmoothQuant
    exists for (the fp model's function changes; both recipes are compared on the same one)."""
    model = _model(tiny_models)
    for block in model.blocks:
        for norm in (block.input_norm, block.post_norm):
            norm.weight.data[[1, 7]] *= 30.0
    return model


def test_smoothing_lowers_the_w8a8_error_on_outlier_channels(tiny_models):
    calib = torch.randint(2, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    ref = _logits(_outlier_model(tiny_models), IDS)
    errs = {}
    for name in ("w8a8", "w8a8-sq"):
        model = _outlier_model(tiny_models)
        res = quantize_model(model, load_recipe(name), calib, log=lambda *a: None)
        errs[name] = (_logits(model, IDS) - ref).pow(2).mean().item()
        if name == "w8a8-sq":
            recs = [r["smoothquant"] for r in res.layers if "smoothquant" in r]
            assert len(recs) == 4 * len(model.blocks)  # qkv, gate_up, down, o per block (v -> o tied per group)
            norm_recs = [r for r in recs if r["smooth"] in ("input_norm", "post_norm")]
            assert all(r["outlier_ratio_after"] < r["outlier_ratio_before"] for r in norm_recs)
    assert errs["w8a8-sq"] < 0.5 * errs["w8a8"], errs


def test_the_alpha_search_keeps_the_best_of_its_grid(tiny_models):
    model = _outlier_model(tiny_models)
    block = model.blocks[0]
    x = torch.randn(2, 24, model.config.hidden_size) * 2
    store = capture(model.config, block, x, ["qkv"], max_tokens=4096, hessian=False)
    W = block.qkv.weight.float()
    alpha, rec = smoothing.search_alpha(store["qkv"], store["max:qkv"], W, 8, None, True)
    assert alpha in smoothing.ALPHA_GRID and rec["mse"] == min(rec["mse_by_alpha"].values())
    at_half = smoothing.smoothed_error(store["qkv"], W, smoothing.smoothquant_scales(store["max:qkv"], W, 0.5),
                                       8, None, True)
    assert rec["mse"] <= at_half
    # the captured max is every token's
    assert torch.equal(store["max:qkv"], store["qkv"].abs().amax(0))


def test_search_is_recorded_per_mapping(tiny_models, tmp_path):
    recipe = tmp_path / "sq.yaml"
    recipe.write_text("name: sq\nweights: {bits: 8, group_size: null, activations: int8}\n"
                      "smoothquant: {alpha: 0.5, search: true}\n")
    model = _outlier_model(tiny_models)
    calib = torch.randint(2, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    res = quantize_model(model, load_recipe(str(recipe)), calib, log=lambda *a: None)
    recs = [r["smoothquant"] for r in res.layers if "smoothquant" in r]
    assert recs and all(r["alpha"] in smoothing.ALPHA_GRID and "mse_by_alpha" in r for r in recs)


@pytest.mark.parametrize("family,recipe", [("llama", "w8a8-sq"), ("qwen2", "w8a8-sq"), ("llama-tied-bias", "w8a8-sq"),
                                           ("qwen2", "w4g128-awq"), ("llama-tied-bias", "w4g128-awq")])
def test_the_artifact_keeps_what_the_calibration_folded(tiny_models, tmp_path, monkeypatch, family, recipe):
    # the smoothed norms, and the biases the folds divided (Qwen2's v bias under SmoothQuant's v -> o with
    # grouped-query attention; every q/k/v/o bias under AWQ's v -> o where KV heads = query heads): the
    # artifact once copied biases from the source checkpoint, and a smoothed Qwen2 lost its v bias's division
    import qbench.engine.api
    import qbench.quant.quantize as qz
    from qbench.quant.artifact import load_artifact
    calib = torch.randint(2, 128, (2, 32), generator=torch.Generator().manual_seed(4))
    # the tiny models have no tokenizer: the calibration windows are given
    monkeypatch.setattr(qbench.engine.api, "load_tokenizer", lambda folder: None)
    monkeypatch.setattr(qz, "calibration_windows", lambda tok, cal: (calib, {"given": True}))
    folder, _ = tiny_models[family]
    out = tmp_path / "art"
    manifest = qz.run_quantize(str(folder), recipe, out, log=lambda s: None)
    loaded, _ = load_artifact(out)
    # the manifest says what computed the calibration, and holds the tensors' digest eval records (issue 21)
    assert manifest["weights_sha256"] == qz.source_sha256(out)
    path = manifest["calibration_path"]
    assert path["qbench_kernels"] in ("avx512", "avx2", "off") and path["aten_cpu_capability"] and path["torch"]
    if recipe == "w8a8-sq":
        assert manifest["recipe"]["smoothquant"] == {"alpha": 0.5, "search": True}
        fp = _model(tiny_models, family)
        assert not torch.equal(loaded.blocks[0].input_norm.weight, fp.blocks[0].input_norm.weight)
        if fp.blocks[0].qkv.bias is not None and fp.blocks[0].qkv.bias.any():  # v bias rows divided by the v -> o scales
            assert not torch.equal(loaded.blocks[0].qkv.bias, fp.blocks[0].qkv.bias)
    inproc = _model(tiny_models, family)
    quantize_model(inproc, load_recipe(recipe), calib, log=lambda *a: None)
    assert torch.equal(_logits(inproc, IDS), _logits(loaded, IDS))  # what was written is what was quantized


def test_the_recipe_checks(tmp_path, tiny_models):
    bad = tmp_path / "bad.yaml"
    cases = {
        "weights: {bits: 8, group_size: null}\nsmoothquant: {alpha: 0.5}": "smoothing serves int8 activations",
        "weights: {bits: 4, group_size: 64, method: awq, activations: int8}\nsmoothquant: {}": "AWQ folds its own",
        "weights: {bits: 8, group_size: null, activations: int8}\nsmoothquant: {alpha: 1.5}":
            r"smoothquant.alpha: 1.5 must be a number in \[0, 1\]",
        "weights: {bits: 8, group_size: null, activations: int8}\nsmoothquant: {beta: 1}": "unknown key smoothquant.beta",
    }
    for body, msg in cases.items():
        bad.write_text("name: b\n" + body + "\n")
        with pytest.raises(RecipeError, match=msg):
            load_recipe(str(bad))
    assert load_recipe("w8a8-sq").needs_calibration and not load_recipe("w8a8").needs_calibration
    model = _model(tiny_models, "gpt2")
    with pytest.raises(QBenchError, match="SmoothQuant is implemented for the Llama family"):
        quantize_model(model, load_recipe("w8a8-sq"), torch.zeros(1, 8, dtype=torch.long), log=lambda *a: None)
