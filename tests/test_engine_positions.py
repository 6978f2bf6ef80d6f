"""Positions everywhere the engine computes logits, against one whole-sequence forward in transformers.

The engine keeps the logits of every position each of its forwards computes (``Engine.trace_logits``):
prefill chunks, the uncached tail after a prefix-cache hit, the recompute after a preemption, and every
decode step. Each is compared with transformers' logits at the same positions of the finished sequence,
so a position bug anywhere (a chunk that restarts at 0, a cache hit that forgets its offset, a recompute
that skips what was generated) fails the test named for the mechanism.
"""

import pytest
import torch

from qbench.engine.engine import Engine
from qbench.engine.sampling import SamplingParams
from qbench.models.registry import load_model

FAMILIES = ["llama", "qwen2", "gpt2", "mistral-window"]
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


def _check_every_position(hf, seqs) -> int:
    """Each traced forward against transformers on the whole sequence -> the number of positions compared."""
    compared = 0
    for s in seqs:
        ids = s.token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]  # (T, V)
        assert s.trace, f"sequence {s.seq_id} computed nothing"
        for start, got in s.trace:
            want = ref[start: start + got.shape[0]]
            assert want.shape == got.shape, (start, got.shape)
            err = (got - want).abs().max().item()
            assert err < 2e-4 * (1 + want.abs().max().item()), \
                f"sequence {s.seq_id}: positions {start}..{start + got.shape[0] - 1} differ by {err:.3g}"
            compared += got.shape[0]
        # every token but the newest was fed at its own position at least once
        fed = set()
        for start, got in s.trace:
            fed.update(range(start, start + got.shape[0]))
        assert fed >= set(range(s.cached_tokens, len(ids) - 1))
    return compared


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_logits_match_transformers_at_every_position(tiny_models, family, path):
    folder, hf = tiny_models[family]
    eng = Engine(load_model(folder), block_size=4, token_budget=8, max_batch=4)
    eng.trace_logits = True
    prompts = [list(range(3, 33)), list(range(40, 59)), [7, 8, 9, 10, 11]]
    seqs = eng.generate(prompts, GREEDY)
    chunks = [(start, g.shape[0]) for start, g in seqs[0].trace if start < len(prompts[0])]
    assert len(chunks) >= 4 and all(n <= 8 for _, n in chunks)  # the 30-token prompt went in pieces
    assert [start for start, _ in chunks] == sorted({start for start, _ in chunks}) and chunks[0][0] == 0
    assert _check_every_position(hf, seqs) >= sum(len(s) - 1 for s in seqs)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hits_match_transformers_at_every_position(tiny_models, family, path):
    folder, hf = tiny_models[family]
    eng = Engine(load_model(folder), block_size=4, prefix_cache=True)
    eng.trace_logits = True
    shared = list(range(5, 25))  # five whole blocks
    eng.generate([shared + [30, 31, 32]], GREEDY)
    before = eng.stats.cached_tokens
    seqs = eng.generate([shared + [40, 41], shared + [50, 51, 52, 53, 54, 55]], GREEDY)
    assert eng.stats.cached_tokens - before >= 2 * 20
    for s in seqs:
        assert s.cached_tokens >= 20 and min(start for start, _ in s.trace) == s.cached_tokens
    _check_every_position(hf, seqs)


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_recompute_matches_transformers_at_every_position(tiny_models, family, path):
    folder, hf = tiny_models[family]
    eng = Engine(load_model(folder), block_size=4, kv_capacity_tokens=48)  # 4 requests of 24 tokens in 48
    eng.trace_logits = True
    prompts = [list(range(2 + i, 14 + i)) for i in range(4)]
    seqs = eng.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert eng.stats.preemptions > 0
    recomputed = [s for s in seqs if any(start == 0 for start, _ in s.trace[1:])]
    assert recomputed  # a preempted request prefilled again from position 0, its generated tokens included
    assert any(g.shape[0] > len(s.prompt_ids) for s in recomputed for start, g in s.trace[1:] if start == 0)
    _check_every_position(hf, seqs)


@pytest.mark.parametrize("weights", [None, {"bits": 4, "group_size": 32}, {"bits": 8, "group_size": None}])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_tokens_logits_do_not_depend_on_the_rest_of_the_batch(tiny_models, family, weights, monkeypatch,
                                                               tmp_path):
    """Every position's logits, alone and beside chunks of the other kernel class (longer and shorter than
    DENSE_ROWS), to the bit: the linears pick their path by rows per sequence and the runner never pads a
    chunk into a pass of the other kind (eval runs at batch 1 and 3, or across processes, must agree)."""
    from qbench.layers import linear
    monkeypatch.setattr(linear, "DENSE_ROWS", 16)
    folder, _ = tiny_models[family]
    if weights is None:
        model = load_model(folder)
    else:  # the integer kernels and the dequantize-then-oneDNN path round differently: the split must hold
        import yaml
        from qbench.quant.artifact import load_artifact
        from qbench.quant.quantize import run_quantize
        recipe = tmp_path / "r.yaml"
        recipe.write_text(yaml.safe_dump({"name": "inv", "weights": {"method": "rtn", **weights}}))
        run_quantize(str(folder), str(recipe), tmp_path / "art", log=lambda m: None)
        model, _ = load_artifact(tmp_path / "art")

    def traced(prompts):
        eng = Engine(model, block_size=4, max_batch=4, prefix_cache=False)
        eng.trace_logits = True
        return eng.generate(prompts, GREEDY)[0].trace

    long, short = list(range(3, 27)), list(range(3, 17))  # 24 tokens (dense path) and 14 (panel kernels)
    cases = [(long, [list(range(40, 50))]), (long, [list(range(40, 50)), list(range(60, 82))]),
             (long, [list(range(90, 126))]), (short, [list(range(40, 57))]), (short, [list(range(60, 64))]),
             (short, [list(range(60, 72))])]  # two short chunks in one pass: 28 rows, still the panel kernels
    for target, others in cases:
        alone, mixed = traced([target]), traced([target] + others)
        assert [s for s, _ in alone] == [s for s, _ in mixed]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(alone, mixed)), (len(target), [len(o) for o in others])
