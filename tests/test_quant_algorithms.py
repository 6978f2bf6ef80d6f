"""AWQ and GPTQ against RTN on real SmolLM2 layers and real calibration activations."""

import pytest
import torch

from qbench.quant import awq, gptq
from qbench.quant.apply import _capture, rtn
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
        from qbench.quant.apply import _block_forward
        for block in model.blocks[:4]:
            x = _block_forward(model.config, block, x)
        block = model.blocks[4]
        store = _capture(model.config, block, x, ["qkv", "o_proj", "gate_up", "down_proj"], max_tokens=512)
    return model, block, store


def out_err(X, W, Wq):
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
