"""The checks every real model gets against transformers: full-sequence logits, cached decode logits, and
greedy generation batched == sequential == transformers."""

import torch

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


def load_pair(folder):
    """(qbench's model, transformers' model, the tokenizer) for one real model folder."""
    from transformers import AutoTokenizer
    return load_model(folder), load_hf_model(folder), AutoTokenizer.from_pretrained(str(folder))


def logits_match(ours, hf, tok, tol: float) -> None:
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    T = ids.shape[1]
    with torch.no_grad():
        ref = hf(ids).logits
    got = ours(ids, AttnMetadata(positions=torch.arange(T)[None]))
    diff = (got - ref).abs().max().item()
    assert diff < tol, diff
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def cached_decode_matches(ours, hf, tok, tol: float) -> None:
    tokens = tok(TEXT)["input_ids"]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0, 20:]
    got = cached_logits(ours, tokens, prompt_len=21, block_size=16)
    assert (got - ref).abs().max().item() < tol
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def batched_equals_sequential_and_transformers(ours, hf, tok, new_tokens: int, window: int) -> None:
    ids = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]) for p in PROMPTS]
    assert len({len(x) for x in ids}) > 1  # uneven lengths
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    eng = Engine(ours)
    batched = [s.output_ids for s in eng.generate(ids, sp)]
    sequential = [eng.generate([p], sp)[0].output_ids for p in ids]
    assert batched == sequential
    ref = [s.output_ids for s in HFBackend(hf, window, set(), pad_id=tok.pad_token_id).generate(ids, sp)]
    assert batched == ref


def one_call_step_equals_layer_by_layer(model, tok, monkeypatch, kv=None, new_tokens: int = 8) -> None:
    """Every decode step's logits on the one-call path (kernels/layer.c) equal the layer-by-layer path's bit for
    bit, on the real model's shapes, batched over prompts of uneven lengths."""
    from qbench.engine import runner as runner_mod

    ids = [tok(p)["input_ids"] for p in PROMPTS]
    logits = {}
    real = runner_mod.ModelRunner.decode
    for fused in ("0", "1"):
        monkeypatch.setenv("QBENCH_FUSED", fused)
        seen = logits.setdefault(fused, [])
        monkeypatch.setattr(runner_mod.ModelRunner, "decode",
                            lambda self, seqs, seen=seen: seen.append((real(self, seqs), self._fused)) or seen[-1][0])
        Engine(model, kv_scheme=kv).generate(ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    monkeypatch.setattr(runner_mod.ModelRunner, "decode", real)
    assert len(logits["0"]) == len(logits["1"]) == new_tokens - 1
    assert all(f is None for _, f in logits["0"]) and all(f is not None for _, f in logits["1"])
    for (a, _), (b, _) in zip(logits["0"], logits["1"]):
        assert torch.equal(a, b)
