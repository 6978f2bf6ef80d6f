"""The real default model, SmolLM2-135M-Instruct, against transformers. Runs in CI too."""

import time

import pytest
import torch

from conftest import SMOL
from qbench.engine.api import Generator
from qbench.engine.engine import Engine
from qbench.engine.hf_backend import HFBackend, load_hf_model
from qbench.engine.sampling import SamplingParams
from qbench.layers.attention import AttnMetadata
from qbench.models.registry import load_model
from test_models_golden import cached_logits

TEXT = ("The Eiffel Tower was completed in 1889 as the entrance arch to the World's Fair. At first many "
        "artists criticised its design, but it soon became a global icon of France and one of the most "
        "visited monuments in the world.")
PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves falling slowly to the ground.",
           "2+2=", "List three prime numbers and explain briefly why each of them is prime."]


@pytest.fixture(scope="module")
def models(smollm2):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    return load_model(smollm2), load_hf_model(smollm2), tok


def test_logits_match_transformers(models):
    ours, hf, tok = models
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    T = ids.shape[1]
    with torch.no_grad():
        ref = hf(ids).logits
    got = ours(ids, AttnMetadata(positions=torch.arange(T)[None]))
    diff = (got - ref).abs().max().item()
    assert diff < 2e-3, diff
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_cached_decode_logits_match_transformers(models):
    ours, hf, tok = models
    tokens = tok(TEXT)["input_ids"]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0, 20:]
    got = cached_logits(ours, tokens, prompt_len=21, block_size=16)
    assert (got - ref).abs().max().item() < 2e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_batched_equals_sequential_and_equals_transformers(models):
    ours, hf, tok = models
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
           for p in PROMPTS]
    ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]
    assert len({len(x) for x in ids}) > 1  # uneven lengths
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    eng = Engine(ours)
    batched = [s.output_ids for s in eng.generate(ids, sp)]
    sequential = [eng.generate([p], sp)[0].output_ids for p in ids]
    assert batched == sequential
    ref = [s.output_ids for s in HFBackend(hf, 8192, set(), pad_id=tok.pad_token_id).generate(ids, sp)]
    assert batched == ref


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
