"""The second real model, Qwen2.5-Coder-0.5B-Instruct (q/k/v bias, untied 151,936-token head), against
transformers, and the whole model quantized. Runs in CI too."""

import pytest
import torch

from conftest import QWEN
from qbench.engine.engine import Engine
from qbench.engine.hf_backend import HFBackend, load_hf_model
from qbench.engine.sampling import SamplingParams
from qbench.layers.attention import AttnMetadata
from qbench.models.registry import load_model
from test_models_golden import cached_logits
from test_smollm2 import PROMPTS, TEXT


@pytest.fixture(scope="module")
def models(qwen):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(qwen))
    return load_model(qwen), load_hf_model(qwen), tok


def test_the_pulled_model_is_the_qwen2_the_issue_names(models):
    ours, _, _ = models
    c = ours.config
    assert (c.model_type, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.vocab_size, c.tie_embeddings) == ("qwen2", 24, 896, 14, 2, 64, 4864, 151936, False)


def test_logits_match_transformers(models):
    ours, hf, tok = models
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    T = ids.shape[1]
    with torch.no_grad():
        ref = hf(ids).logits
    got = ours(ids, AttnMetadata(positions=torch.arange(T)[None]))
    assert (got - ref).abs().max().item() < 5e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_cached_decode_logits_match_transformers(models):
    ours, hf, tok = models
    tokens = tok(TEXT)["input_ids"]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0, 20:]
    got = cached_logits(ours, tokens, prompt_len=21, block_size=16)
    assert (got - ref).abs().max().item() < 5e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_batched_equals_sequential_and_equals_transformers(models):
    ours, hf, tok = models
    ids = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]) for p in PROMPTS]
    assert len({len(x) for x in ids}) > 1  # uneven lengths
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    eng = Engine(ours)
    batched = [s.output_ids for s in eng.generate(ids, sp)]
    sequential = [eng.generate([p], sp)[0].output_ids for p in ids]
    assert batched == sequential
    ref = [s.output_ids for s in HFBackend(hf, 32768, set(), pad_id=tok.pad_token_id).generate(ids, sp)]
    assert batched == ref


def test_the_whole_model_quantized_fits_the_size_target(qwen, tmp_path):
    """w4g128 with an INT8 head and an INT8 embedding: <= 480 MiB of tensors held by the engine (the fp32
    head and table alone were 1,090 MB), and it still answers like the fp model on a short greedy run."""
    from qbench.engine.api import Generator
    from qbench.quant.quantize import run_quantize
    m = run_quantize(QWEN, "w4g128-h8e8", tmp_path / "a", log=lambda s: None)
    assert m["embedding"]["scheme"] == "int8" and not m["embedding"]["shared_with_lm_head"]
    assert m["quantized"]["lm_head"]["scheme"] == {"bits": 8, "group_size": None, "symmetric": True}
    gen = Generator(str(tmp_path / "a"))
    held = gen.engine.model.weight_bytes()
    assert held <= 480 * 2**20, held / 2**20
    assert held == pytest.approx(m["size"]["artifact_tensor_bytes"], rel=0.01)
    assert m["size"]["bits_per_weight_all"] < 8 * 480 * 2**20 / m["size"]["parameters"]
    [c] = gen.generate(["What is 12 + 30? Answer with the number only."], SamplingParams(max_new_tokens=8), chat=True)
    assert "42" in c.text
