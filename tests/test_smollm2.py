"""The real default model, SmolLM2-135M-Instruct, against transformers. Runs in CI too."""

import time

import pytest

from conftest import SMOL
from qbench.kernels import build
from qbench.engine.api import Generator
from qbench.engine.sampling import SamplingParams
from real_model_checks import (batched_equals_sequential_and_transformers, cached_decode_matches, load_pair,
                               logits_match, one_call_step_equals_layer_by_layer)


@pytest.fixture(scope="module")
def models(smollm2):
    return load_pair(smollm2)


def test_logits_match_transformers(models):
    logits_match(*models, tol=2e-3)


def test_cached_decode_logits_match_transformers(models):
    cached_decode_matches(*models, tol=2e-3)


def test_batched_equals_sequential_and_equals_transformers(models):
    batched_equals_sequential_and_transformers(*models, new_tokens=24, window=8192)


@pytest.mark.skipif(not build.available(), reason="native kernels not built here")
def test_the_one_call_decode_step_equals_the_layer_by_layer_step(models, smollm2, monkeypatch):
    from qbench.layers.kvscheme import KVScheme
    from qbench.models.registry import load_model
    from qbench.quant.apply import quantize_model
    from qbench.quant.recipe import load_recipe

    ours, _, tok = models
    one_call_step_equals_layer_by_layer(ours, tok, monkeypatch)
    q = load_model(smollm2)
    quantize_model(q, load_recipe("w4g64-head"), None, log=lambda *a: None)
    one_call_step_equals_layer_by_layer(q, tok, monkeypatch, kv=KVScheme(4, 4), new_tokens=20)


def test_generate_chat_stops_at_eos_and_at_stop_strings():
    gen = Generator(SMOL)
    [c] = gen.generate(["What is 2+2? Answer with the number only."], SamplingParams(max_new_tokens=40), chat=True)
    assert "4" in c.text and c.finish_reason == "eos"
    [c] = gen.generate(["Count from 1 to 10, separated by commas."],
                       SamplingParams(max_new_tokens=40, stop=(",",)), chat=True)
    assert c.finish_reason == "stop" and "," not in c.text and c.text.strip() != ""


def test_second_pull_is_instant_and_offline(monkeypatch, smollm2):
    from qbench.models import zoo
    monkeypatch.setattr(zoo.subprocess, "run", lambda *a, **k: pytest.fail("pull must not download again"))
    t = time.perf_counter()
    assert zoo.pull(SMOL) == smollm2
    assert time.perf_counter() - t < 1.0
    src = (smollm2 / "qbench_source.json").read_text()
    assert zoo.ZOO[SMOL].parts[0].sha256 in src and "gguf_sha256" in src
