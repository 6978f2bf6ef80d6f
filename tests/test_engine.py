"""The engine: batching, positions, the in-place block cache, stopping, per-request RNG."""

import pytest
import torch

from conftest import FAMILIES
from qbench.engine import block_manager as bm_mod
from qbench.engine import kv_cache as kv_mod
from qbench.engine.engine import Engine
from qbench.engine.hf_backend import HFBackend
from qbench.engine.sampling import SamplingParams
from qbench.engine.sequence import Sequence
from qbench.engine.stopping import check_finished
from qbench.errors import QBenchError
from qbench.models.registry import load_model

UNEVEN = [[5, 6, 7], list(range(10, 19)), list(range(20, 37)), list(range(40, 70))]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_equals_sequential(tiny_models, family, path):
    folder, _ = tiny_models[family]
    eng = Engine(load_model(folder), block_size=4)
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    batched = [s.output_ids for s in eng.generate(UNEVEN, sp)]
    sequential = [eng.generate([p], sp)[0].output_ids for p in UNEVEN]
    assert batched == sequential


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_uneven_prompts_get_their_own_positions(tiny_models, family, path):
    folder, hf = tiny_models[family]
    model = load_model(folder)
    eng = Engine(model, block_size=4)
    eng._ensure_pool(256)
    seqs = [Sequence(p, SamplingParams()) for p in UNEVEN]
    for s in seqs:
        eng.blocks.reserve(s, len(s))
    batched = eng.runner.prefill(seqs)
    with torch.no_grad():
        alone = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in UNEVEN])
    assert (batched - alone).abs().max() < 2e-4


def test_left_padding_without_cumsum_positions_breaks_short_prompts(tiny_models):
    """The seeds' bug, reproduced on transformers: arange positions on a left-padded batch are wrong.

    It bites GPT-2's absolute learned positions; RoPE scores depend only on relative offsets,
    so a Llama model shifted by the padding gives the same answer up to rounding.
    """
    _, hf = tiny_models["gpt2"]
    short, long = UNEVEN[0], UNEVEN[2]
    pad = len(long) - len(short)
    ids = torch.tensor([[0] * pad + short, long])
    mask = torch.tensor([[0] * pad + [1] * len(short), [1] * len(long)])
    with torch.no_grad():
        alone = hf(torch.tensor([short])).logits[0, -1]
        naive = hf(ids, attention_mask=mask, position_ids=torch.arange(ids.shape[1]).expand(2, -1)).logits[0, -1]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        fixed = hf(ids, attention_mask=mask, position_ids=pos).logits[0, -1]
    assert (fixed - alone).abs().max() < 1e-4
    assert (naive - alone).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_backend_agrees_with_engine_on_uneven_batch(tiny_models, family):
    folder, hf = tiny_models[family]
    model = load_model(folder)
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
    ours = [s.output_ids for s in Engine(model, block_size=4).generate(UNEVEN, sp)]
    ref = [s.output_ids for s in HFBackend(hf, model.config.max_positions, set()).generate(UNEVEN, sp)]
    assert ours == ref


def test_cache_is_preallocated_and_written_in_place(tiny_models, monkeypatch):
    folder, _ = tiny_models["llama"]
    eng = Engine(load_model(folder), block_size=4)
    pools = []
    real_pool = kv_mod.KVPool

    def counting_pool(*a, **k):
        pools.append(real_pool(*a, **k))
        return pools[-1]

    monkeypatch.setattr("qbench.engine.engine.KVPool", counting_pool)
    cats = []
    real_cat = torch.cat

    def spy_cat(tensors, *a, **k):
        pool_ptrs = {p.k.untyped_storage().data_ptr() for p in pools} | {p.v.untyped_storage().data_ptr() for p in pools}
        cats.extend(t for t in tensors if t.untyped_storage().data_ptr() in pool_ptrs)
        return real_cat(tensors, *a, **k)

    monkeypatch.setattr(torch, "cat", spy_cat)
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    eng.generate(UNEVEN, sp)
    ptr = (eng.pool.k.data_ptr(), eng.pool.v.data_ptr())
    assert eng.pool.k.abs().sum() > 0  # keys were written into the pool
    eng.generate(UNEVEN, sp)
    assert len(pools) == 1 and (eng.pool.k.data_ptr(), eng.pool.v.data_ptr()) == ptr
    assert cats == []  # the cache never grows by concatenation


def test_blocks_are_allocated_only_at_boundaries(tiny_models, monkeypatch):
    folder, _ = tiny_models["llama"]
    eng = Engine(load_model(folder), block_size=4)
    events = []
    real = bm_mod.BlockManager.reserve

    def spy(self, seq, n):
        before = len(seq.block_table)
        real(self, seq, n)
        events.append((n, len(seq.block_table) - before))

    monkeypatch.setattr(bm_mod.BlockManager, "reserve", spy)
    eng.generate([list(range(2, 9))], SamplingParams(max_new_tokens=12, ignore_eos=True))
    for n, added in events[1:]:  # after the prompt: one block exactly when a token starts a new block
        assert added == (1 if (n - 1) % 4 == 0 else 0)


def test_block_manager_boundary_arithmetic_from_the_seeds():
    bm = bm_mod.BlockManager(100, 16)
    s = Sequence([1], SamplingParams())
    bm.reserve(s, 1000)
    assert len(s.block_table) == 63
    bm.reserve(s, 1008)
    assert len(s.block_table) == 63
    bm.reserve(s, 1009)
    assert len(s.block_table) == 64
    bm.release(s)
    assert bm.num_free == 100 and s.block_table == []
    with pytest.raises(bm_mod.OutOfBlocks):
        bm.reserve(s, 16 * 101)


def test_sampled_output_does_not_depend_on_the_batch(tiny_models):
    folder, _ = tiny_models["llama"]
    eng = Engine(load_model(folder), block_size=4)
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_new_tokens=15, seed=7, ignore_eos=True)
    alone = eng.generate([UNEVEN[1]], sp)[0].output_ids
    others = SamplingParams(temperature=1.0, max_new_tokens=15, seed=99, ignore_eos=True)
    in_batch = eng.generate([UNEVEN[0], UNEVEN[1], UNEVEN[3]], [others, sp, others])[1].output_ids
    assert alone == in_batch
    different_seed = eng.generate([UNEVEN[1]], SamplingParams(temperature=1.0, max_new_tokens=15, seed=8,
                                                              ignore_eos=True))[0].output_ids
    assert different_seed != alone


def test_stopping_rules():
    detok = lambda ids: "".join(chr(96 + i) for i in ids)  # noqa: E731  1->a, 2->b ...
    s = Sequence([1], SamplingParams(max_new_tokens=3))
    for t in (3, 4, 5):
        s.output_ids.append(t)
        check_finished(s, t, {2}, 100, detok)
    assert s.finish_reason == "length" and s.text == "cde"
    s = Sequence([1], SamplingParams(max_new_tokens=9))
    s.output_ids.append(2)
    check_finished(s, 2, {2}, 100, detok)
    assert s.finish_reason == "eos"
    s = Sequence([1], SamplingParams(max_new_tokens=9, stop=("cd",)))
    for t in (1, 3, 4):
        s.output_ids.append(t)
        check_finished(s, t, {2}, 100, detok)
        if s.finished:
            break
    assert s.finish_reason == "stop" and s.text == "a"
    s = Sequence([1, 1, 1], SamplingParams(max_new_tokens=9))
    s.output_ids.append(5)
    check_finished(s, 5, {2}, 4, detok)
    assert s.finish_reason == "context"


def test_engine_stops_at_max_new_tokens_and_eos(tiny_models):
    folder, _ = tiny_models["llama"]
    model = load_model(folder)
    eng = Engine(model, block_size=4)
    out = eng.generate(UNEVEN, SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert all(len(s.output_ids) == 5 and s.finish_reason == "length" for s in out)
    first = out[0].output_ids[0]
    eng.eos_ids = {first}  # make the first greedy token an EOS: generation must stop there
    again = eng.generate([UNEVEN[0]], SamplingParams(max_new_tokens=5))[0]
    assert again.output_ids == [first] and again.finish_reason == "eos"


def test_prompt_longer_than_the_window_is_refused(tiny_models):
    folder, _ = tiny_models["llama"]
    eng = Engine(load_model(folder))
    with pytest.raises(QBenchError, match="context window is 256"):
        eng.generate([list(range(300))], SamplingParams())
