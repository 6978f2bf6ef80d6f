"""The engine's KIVI-quantized block pool: quantize-once at block boundaries, a full-precision residual,
batched == sequential, and KV8 quality on SmolLM2."""

import pytest
import torch

from qbench.engine.engine import Engine
from qbench.engine.sampling import SamplingParams
from qbench.engine.sequence import Sequence
from qbench.layers import kvquant as kq
from qbench.layers.kvquant import KVScheme
from qbench.models.registry import load_model

UNEVEN = [[5, 6, 7], list(range(10, 19)), list(range(20, 37)), list(range(40, 70))]


def step_through(model, tokens, prompt_len, scheme, bs=16):
    """Prefill tokens[:prompt_len], then decode the rest one at a time; return the engine and sequence."""
    eng = Engine(model, block_size=bs, kv_capacity_tokens=256, kv_scheme=scheme)
    s = Sequence(tokens[:prompt_len], SamplingParams())
    eng.blocks.reserve(s, len(s))
    eng.runner.prefill([s])
    snapshots = []
    for t in tokens[prompt_len:]:
        s.output_ids.append(t)
        eng.blocks.reserve(s, len(s))
        eng.runner.decode([s])
        if scheme is not None:
            snapshots.append(eng.pool.store["kq"][0, s.block_table[0]].clone())
    return eng, s, snapshots


@pytest.mark.parametrize("prompt_len", [15, 16, 17])
def test_groups_quantize_at_block_boundaries_and_the_residual_stays_exact(tiny_models, prompt_len):
    folder, _ = tiny_models["llama"]
    model = load_model(folder)
    tokens = torch.randint(2, 128, (prompt_len + 3,), generator=torch.Generator().manual_seed(1)).tolist()
    ref_eng, ref_seq, _ = step_through(model, tokens, prompt_len, None)
    eng, seq, _ = step_through(model, tokens, prompt_len, KVScheme(4, 4, group=16, v_group=16, residual=16))
    n = len(seq)
    # layer 0's keys and values do not depend on the cache, so the fp engine's are the truth
    fk = ref_eng.pool.k[0][torch.tensor(ref_seq.block_table)].reshape(-1, 2, 16)[:n]
    fv = ref_eng.pool.v[0][torch.tensor(ref_seq.block_table)].reshape(-1, 2, 16)[:n]
    from qbench.layers.attention import AttnMetadata
    meta = AttnMetadata(positions=torch.zeros(1, 1, dtype=torch.int64),
                        block_tables=torch.tensor([seq.block_table]), context_lens=torch.tensor([n]),
                        kv_slots=torch.tensor([0]))
    k, v = eng.pool.layers[0].read_meta(meta)
    k, v = k[0].transpose(0, 1)[:n], v[0].transpose(0, 1)[:n]  # (n, nkv, hd)
    full = n // 16 * 16
    if full:  # the completed group: exactly one quantize of its 16 fp tokens
        qk = kq.dequantize_k_per_channel(kq.quantize_k_per_channel(fk[:full], 4))
        qv = kq.dequantize_v_per_token(kq.quantize_v_per_token(fv[:full], 4, 16))
        assert torch.allclose(k[:full], qk, atol=1e-6) and torch.allclose(v[:full], qv, atol=1e-6)
        assert not torch.allclose(k[:full], fk[:full], atol=1e-6)  # it really is quantized
    assert torch.equal(k[full:], fk[full:]) and torch.equal(v[full:], fv[full:])  # the residual is exact


def test_a_quantized_group_is_never_requantized(tiny_models):
    folder, _ = tiny_models["llama"]
    tokens = list(range(2, 60))
    _, _, snaps = step_through(load_model(folder), tokens, 16, KVScheme(4, 2, group=16, v_group=16, residual=16))
    assert all(torch.equal(snaps[0], s) for s in snaps)  # block 0's bytes after 42 more tokens


@pytest.mark.parametrize("scheme", [KVScheme(8, 8, v_group=16), KVScheme(4, 2, v_group=16)])
def test_batched_equals_sequential_with_a_quantized_cache(tiny_models, scheme):
    folder, _ = tiny_models["llama"]
    eng = Engine(load_model(folder), block_size=16, kv_scheme=scheme)
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    assert [s.output_ids for s in eng.generate(UNEVEN, sp)] == [eng.generate([p], sp)[0].output_ids for p in UNEVEN]


def test_kv8_top1_agrees_with_fp_on_a_fixed_text(smollm2):
    from qbench.engine.api import load_tokenizer
    from qbench.layers.attention import AttnMetadata
    from qbench.quant.calibration import PROJECT_ROOT
    model = load_model(smollm2)
    text = (PROJECT_ROOT / "evals/data/wikitext-2-raw/wiki.test.raw").read_text(encoding="utf-8")[:3000]
    ids = load_tokenizer(smollm2)(text)["input_ids"][:300]
    ref = model(torch.tensor([ids]), AttnMetadata(positions=torch.arange(len(ids))[None]))[0, 16:].argmax(-1)
    eng = Engine(model, kv_capacity_tokens=512, kv_scheme=KVScheme(8, 8))
    s = Sequence(ids[:17], SamplingParams())
    eng.blocks.reserve(s, len(s))
    out = [eng.runner.prefill([s])]
    for t in ids[17:]:
        s.output_ids.append(t)
        eng.blocks.reserve(s, len(s))
        out.append(eng.runner.decode([s]))
    agree = (torch.cat(out).argmax(-1) == ref).float().mean().item()
    assert agree >= 0.99, agree
