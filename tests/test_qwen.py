"""The second real model, Qwen2.5-Coder-0.5B-Instruct (q/k/v bias, untied 151,936-token head), against
transformers, and the whole model quantized. Runs in CI too."""

import pytest

from conftest import QWEN
from qbench.kernels import build
from qbench.engine.sampling import SamplingParams
from real_model_checks import (batched_equals_sequential_and_transformers, cached_decode_matches, load_pair,
                               logits_match, one_call_step_equals_layer_by_layer)


@pytest.fixture(scope="module")
def models(qwen):
    return load_pair(qwen)


def test_the_pulled_model_is_the_qwen2_the_issue_names(models):
    ours, _, _ = models
    c = ours.config
    assert (c.model_type, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.vocab_size, c.tie_embeddings) == ("qwen2", 24, 896, 14, 2, 64, 4864, 151936, False)


def test_logits_match_transformers(models):
    logits_match(*models, tol=5e-3)


def test_cached_decode_logits_match_transformers(models):
    cached_decode_matches(*models, tol=5e-3)


def test_batched_equals_sequential_and_equals_transformers(models):
    batched_equals_sequential_and_transformers(*models, new_tokens=16, window=32768)


@pytest.mark.skipif(not build.available(), reason="native kernels not built here")
def test_the_one_call_decode_step_equals_the_layer_by_layer_step(models, monkeypatch):
    from qbench.layers.kvscheme import KVScheme

    ours, _, tok = models
    one_call_step_equals_layer_by_layer(ours, tok, monkeypatch)
    one_call_step_equals_layer_by_layer(ours, tok, monkeypatch, kv=KVScheme(scheme="fp16"))


def test_the_whole_model_quantized_fits_the_size_target(qwen, tmp_path):
    """w4g128 with an INT8 head and an INT8 embedding: <= 480 MiB of tensors held by the engine (the fp32
    head and table alone were 1,090 MB), and it still answers like the fp model on a short greedy run."""
    from qbench.engine.api import Generator
    from qbench.quant.quantize import run_quantize
    m = run_quantize(QWEN, "w4g128-h8e8", tmp_path / "a", log=lambda s: None)
    assert m["embedding"]["scheme"] == "int8" and not m["embedding"]["shared_with_lm_head"]
    assert m["quantized"]["lm_head"]["scheme"] == {"bits": 8, "group_size": None, "symmetric": True}
    gen = Generator(str(tmp_path / "a"))
    held = gen.backend.model.weight_bytes()
    assert held <= 480 * 2**20, held / 2**20
    assert held == pytest.approx(m["size"]["artifact_tensor_bytes"], rel=0.01)
    assert m["size"]["bits_per_weight_all"] < 8 * 480 * 2**20 / m["size"]["parameters"]
    [c] = gen.generate(["What is 12 + 30? Answer with the number only."], SamplingParams(max_new_tokens=8), chat=True)
    assert "42" in c.text
