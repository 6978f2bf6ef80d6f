"""The real default model, SmolLM2-135M-Instruct, against transformers. Runs in CI too."""

import time

import pytest

from conftest import SMOL
from qbench.engine.api import Generator
from qbench.engine.sampling import SamplingParams
from real_model_checks import (batched_equals_sequential_and_transformers, cached_decode_matches, load_pair,
                               logits_match)


@pytest.fixture(scope="module")
def models(smollm2):
    return load_pair(smollm2)


def test_logits_match_transformers(models):
    logits_match(*models, tol=2e-3)


def test_cached_decode_logits_match_transformers(models):
    cached_decode_matches(*models, tol=2e-3)


def test_batched_equals_sequential_and_equals_transformers(models):
    batched_equals_sequential_and_transformers(*models, new_tokens=24, window=8192)


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
