"""AWQ and GPTQ against RTN on real SmolLM2 layers and real calibration activations."""

import pytest
import torch

from qbench.quant import awq, gptq
from qbench.quant.apply import rtn
from qbench.quant.passes import capture
from qbench.quant.calibration import calibration_windows
from qbench.quant.primitives import dequantize, fake_quantize
from qbench.quant.recipe import Calibration


@pytest.fixture(scope="module")
def layer_inputs(smollm2):
    """Inputs of block 4's linears on 4 WikiText-2 valid windows of 128 tokens."""
    from qbench.engine.api import load_tokenizer
    from qbench.models.registry import load_model
    model = load_model(smollm2)
    calib, _ = calibration_windows(load_tokenizer(smollm2), Calibration(samples=4, seq_len=128, seed=0))
    with torch.inference_mode():
        x = model.embed(calib, torch.arange(128).expand_as(calib))
        from qbench.quant.passes import block_forward
        for block in model.blocks[:4]:
            x = block_forward(model.config, block, x)
        block = model.blocks[4]
        store = capture(model.config, block, x, ["qkv", "o_proj", "gate_up", "down_proj"], max_tokens=512)
    return model, block, store


def out_err(X, W, Wq):
    X, W, Wq = X.double(), W.double(), Wq.double()  # capture keeps float64, the calibration's precision
    ref = X @ W.t()
    return ((X @ Wq.t() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("name", ["qkv", "gate_up", "down_proj"])
@pytest.mark.parametrize("bits,group,sym", [(4, 128, True), (4, 64, False), (8, None, True)])
def test_gptq_beats_rtn_on_layer_output(layer_inputs, name, bits, group, sym):
    _, block, store = layer_inputs
    W = block.get_submodule(name).weight.float()
    X = store[name]
    e_rtn = out_err(X, W, dequantize(rtn(W, bits, group, sym)))
    e_gptq = out_err(X, W, dequantize(gptq.gptq_quantize(W, store["H:" + name], bits, group, sym)))
    assert e_gptq < e_rtn, (e_gptq, e_rtn)


@pytest.mark.parametrize("name", ["qkv", "gate_up", "down_proj"])
def test_gptq_act_order_also_beats_rtn(layer_inputs, name):
    _, block, store = layer_inputs
    W = block.get_submodule(name).weight.float()
    X = store[name]
    q = gptq.gptq_quantize(W, store["H:" + name], 4, 128, True, act_order=True)
    assert out_err(X, W, dequantize(q)) < out_err(X, W, dequantize(rtn(W, 4, 128, True)))


@pytest.mark.parametrize("name", ["qkv", "gate_up", "down_proj"])
@pytest.mark.parametrize("group,sym", [(128, True), (64, False)])
def test_awq_beats_rtn_on_layer_output(layer_inputs, name, group, sym):
    _, block, store = layer_inputs
    W = block.get_submodule(name).weight.float()
    X = store[name]
    s, rec = awq.search_scales(X, W, 4, group, sym, grid=20)
    e_awq = out_err(X, W, fake_quantize(W * s, 4, group, sym) / s)
    e_rtn = out_err(X, W, fake_quantize(W, 4, group, sym))
    assert e_awq < e_rtn, (e_awq, e_rtn, rec)


def _clip_reference(X, W, bits, group, sym, grid=20, max_shrink=0.5):
    """AWQ's clip search one (row, group) at a time: the slow, obviously correct version of search_clip."""
    from qbench.quant.awq import CLIP_TOKENS
    X = X.float()[:: max(1, X.shape[0] // CLIP_TOKENS)][:CLIP_TOKENS].double()
    N, K = W.shape
    G = group or K
    out = torch.zeros(N, -(-K // G), dtype=torch.float64)
    for r in range(N):
        for g in range(out.shape[1]):
            cols = slice(g * G, min((g + 1) * G, K))
            w = W[r, cols].float()
            ref = X[:, cols] @ w.double()
            best, best_m = float("inf"), None
            for i in range(int(max_shrink * grid)):
                m = w.abs().max() * (1 - i / grid)
                full = W[r:r + 1].float().clone()
                full[0, cols] = w.clamp(-m, m)
                wq = fake_quantize(full, bits, group, sym)[0, cols]  # the row's grid for this group
                err = (X[:, cols] @ wq.double() - ref).pow(2).mean().item()
                if err < best:
                    best, best_m = err, m
            out[r, g] = best_m
    return out


@pytest.mark.parametrize("bits,group,sym", [(4, 128, True), (4, 64, False), (8, None, True)])
def test_awq_clip_search_equals_a_per_group_loop(layer_inputs, bits, group, sym):
    _, block, store = layer_inputs
    W = block.get_submodule("down_proj").weight.float()[:6]  # a few rows: the reference loops in Python
    X = store["down_proj"]
    got, rec = awq.search_clip(X, W, bits, group, sym)
    ref = _clip_reference(X, W, bits, group, sym)
    assert torch.allclose(got, ref, rtol=1e-6, atol=0), (got, ref)
    assert 0 <= rec["clipped_fraction"] <= 1


@pytest.mark.parametrize("name", ["qkv", "gate_up", "down_proj"])
def test_awq_clip_never_loses_on_a_groups_output_and_helps_the_layer(layer_inputs, name):
    _, block, store = layer_inputs
    W = block.get_submodule(name).weight.float()
    X = store[name]
    clip, rec = awq.search_clip(X, W, 4, 128, True)
    K = W.shape[1]
    group_max = torch.nn.functional.pad(W.abs(), (0, -K % 128)).view(W.shape[0], -1, 128).amax(-1)
    assert bool((clip <= group_max).all()) and bool((clip >= 0.5 * group_max).all())
    Wc = awq.apply_clip(W, clip, 128)
    assert rec["clipped_fraction"] > 0  # real layers have groups whose outliers cost more than they carry
    # the search scores each group alone, on every 16th token; the whole layer on all tokens improves too
    assert out_err(X, W, fake_quantize(Wc, 4, 128, True)) < out_err(X, W, fake_quantize(W, 4, 128, True))


def test_apply_clip_clamps_each_group_to_its_value():
    W = torch.tensor([[3.0, -5.0, 1.0, 0.5, -0.2]])
    clip = torch.tensor([[2.0, 0.3, 9.0]])
    assert torch.equal(awq.apply_clip(W, clip, 2), torch.tensor([[2.0, -2.0, 0.3, 0.3, -0.2]]))


def test_a_recipe_with_awq_clip_records_the_search_and_leaves_q_and_k_alone(tiny_models, tmp_path):
    from qbench.models.registry import load_model
    from qbench.quant.apply import quantize_model
    from qbench.quant.recipe import load_recipe
    folder, _ = tiny_models["llama"]
    body = "weights: {bits: 4, group_size: 32, symmetric: true, method: awq}\n"
    (tmp_path / "plain.yaml").write_text("name: plain\n" + body)
    (tmp_path / "clip.yaml").write_text("name: clip\n" + body + "awq: {clip: true}\n")
    calib = torch.randint(2, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    out = {}
    for name in ("plain", "clip"):
        recipe = load_recipe(str(tmp_path / f"{name}.yaml"))
        assert recipe.awq.clip is (name == "clip")
        out[name] = quantize_model(load_model(folder), recipe, calib, log=lambda *a: None)
    recs = [r for r in out["clip"].layers if "awq_clip" in r]
    assert {r["module"] for r in recs} == {f"blocks.{b}.{n}" for b in range(2)
                                           for n in ("qkv", "o_proj", "gate_up", "down_proj")}
    qkv = next(r for r in recs if r["module"] == "blocks.0.qkv")
    assert qkv["awq_clip"]["rows"] == [(4 + 2) * 16, (4 + 2 + 2) * 16]  # v's rows only (4 q heads, 2 kv, hd 16)
    assert not any("awq_clip" in r for r in out["plain"].layers)
    a, b = out["plain"].qtensors, out["clip"].qtensors
    assert torch.equal(a["blocks.0.qkv"].codes[:96], b["blocks.0.qkv"].codes[:96])  # q and k: untouched
    assert any(not torch.equal(a[k].codes, b[k].codes) for k in a)


def test_awq_clip_must_be_a_boolean(tmp_path):
    from qbench.quant.recipe import RecipeError, load_recipe
    f = tmp_path / "r.yaml"
    f.write_text("name: r\nweights: {bits: 4, group_size: 128, method: awq}\nawq: {clip: 'yes'}\n")
    with pytest.raises(RecipeError, match=r"r.yaml.*awq.clip"):
        load_recipe(str(f))
    f.write_text("name: r\nweights: {bits: 4, group_size: 128, method: gptq}\nawq: {clip: true}\n")
    with pytest.raises(RecipeError, match=r"r.yaml: awq.clip: .*method: awq"):
        load_recipe(str(f))
