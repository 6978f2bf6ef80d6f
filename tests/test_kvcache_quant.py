"""The engine's KIVI-quantized block pool: quantize-once at block boundaries, a full-precision residual,
batched == sequential, and KV8 quality on SmolLM2."""

import pytest
import torch

from qbench.engine.engine import Engine
from qbench.engine.sampling import SamplingParams
from qbench.engine.sequence import Sequence
from qbench.layers import kvquant as kq
from qbench.layers.kvscheme import KVScheme
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
            snapshots.append(eng.pool.store["kc"][0, s.block_table[0]].clone())
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


def teacher_forced(smollm2, schemes, n):
    """fp logits of a fixed WikiText-2 text in one cache-free pass, and each scheme's logits when the
    engine prefills 17 tokens and then decodes the rest one at a time through its quantized cache."""
    from qbench.engine.api import load_tokenizer
    from qbench.layers.attention import AttnMetadata
    from qbench.quant.calibration import PROJECT_ROOT
    model = load_model(smollm2)
    text = (PROJECT_ROOT / "evals/data/wikitext-2-raw/wiki.test.raw").read_text(encoding="utf-8")[:3000]
    ids = load_tokenizer(smollm2)(text)["input_ids"][:n]
    ref = model(torch.tensor([ids]), AttnMetadata(positions=torch.arange(len(ids))[None]))[0, 16:]
    outs = []
    for scheme in schemes:
        eng = Engine(model, kv_capacity_tokens=512, kv_scheme=scheme)
        s = Sequence(ids[:17], SamplingParams())
        eng.blocks.reserve(s, len(s))
        out = [eng.runner.prefill([s])]
        for t in ids[17:]:
            s.output_ids.append(t)
            eng.blocks.reserve(s, len(s))
            out.append(eng.runner.decode([s]))
        outs.append(torch.cat(out))
    return ref, outs


def test_kv8_top1_agrees_with_fp_on_a_fixed_text(smollm2):
    ref, (out,) = teacher_forced(smollm2, [KVScheme(8, 8)], 300)
    agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.99, agree


def test_per_channel_k_beats_per_token_k_and_per_tensor_at_the_model_output(smollm2):
    """The K-outlier asymmetry, measured end to end: the same 4-bit budget, three ways to spend it."""
    schemes = [KVScheme(4, 4), KVScheme(4, 4, scheme="per-token-k"), KVScheme(4, 4, scheme="per-tensor")]
    ref, outs = teacher_forced(smollm2, schemes, 160)
    kl = [torch.nn.functional.kl_div(o.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                     reduction="batchmean").item() for o in outs]
    print("K4V4 KL against fp: kivi, per-token K, per-tensor", kl)
    assert kl[0] < kl[1] < kl[2], kl


def test_a_longer_residual_window_keeps_the_newest_blocks_exact(tiny_models):
    """R = 2G: the unfinished block and the newest full block stay in full precision, older ones are
    quantized once; the bytes of a quantized block never change afterwards."""
    folder, _ = tiny_models["llama"]
    model = load_model(folder)
    tokens = torch.randint(2, 128, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    ref_eng, ref_seq, _ = step_through(model, tokens, 20, None)
    eng, seq, snaps = step_through(model, tokens, 20, KVScheme(4, 4, group=16, v_group=16, residual=32))
    from qbench.layers.attention import AttnMetadata
    n = len(seq)  # 70 tokens: blocks 0..2 quantized, block 3 (48..63) and 64..69 in the ring
    assert eng.pool.layers[0].quantized_blocks(n) == 3
    meta = AttnMetadata(positions=torch.zeros(1, 1, dtype=torch.int64), block_tables=torch.tensor([seq.block_table]),
                        context_lens=torch.tensor([n]), kv_slots=torch.tensor([0]))
    k = eng.pool.layers[0].read_meta(meta)[0][0].transpose(0, 1)[:n]
    fk = ref_eng.pool.k[0][torch.tensor(ref_seq.block_table)].reshape(-1, 2, 16)[:n]
    assert torch.equal(k[48:], fk[48:])
    for b in range(3):
        qk = kq.dequantize_k_per_channel(kq.quantize_k_per_channel(fk[16 * b: 16 * b + 16], 4))
        assert torch.allclose(k[16 * b: 16 * b + 16], qk, atol=1e-6)
    # block 0 was quantized when token 32 arrived (prefill of 20 leaves it in the window): from then on fixed
    assert all(torch.equal(snaps[-1], s) for s in snaps[32 - 20:])


SCHEMES = [KVScheme(8, 8, v_group=16), KVScheme(4, 2, v_group=16), KVScheme(4, 4, v_group=16, residual=48),
           KVScheme(8, 8, scheme="fp8"), KVScheme(4, 4, scheme="per-tensor"),
           KVScheme(4, 4, v_group=16, scheme="per-token-k"), KVScheme(16, 4, v_group=16)]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.describe())
def test_batched_equals_sequential_for_every_scheme(tiny_models, scheme):
    folder, _ = tiny_models["llama"]
    eng = Engine(load_model(folder), block_size=16, kv_scheme=scheme)
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    assert [s.output_ids for s in eng.generate(UNEVEN, sp)] == [eng.generate([p], sp)[0].output_ids for p in UNEVEN]


def test_quantization_off_is_bit_identical_to_the_fp_cache(tiny_models, monkeypatch):
    """The quantized pool's read path with K16V16 codecs returns exactly the fp cache's logits."""
    from qbench.engine.kv_cache import QuantKVPool
    from qbench.engine.runner import ModelRunner
    from qbench.kernels import build
    monkeypatch.setattr(build, "available", lambda: False)  # the fp pool's torch path, the same SDPA call
    folder, _ = tiny_models["llama"]
    model = load_model(folder)
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    fp = Engine(model, block_size=16, kv_capacity_tokens=512)
    off = Engine(model, block_size=16, kv_capacity_tokens=512)
    cfg = model.config
    off.pool = QuantKVPool(cfg.num_layers, 32, 16, cfg.num_kv_heads, cfg.head_dim, model.dtype,
                           KVScheme(16, 16), off.max_batch)
    off.runner = ModelRunner(model, off.pool)
    logits = {}
    for name, eng in (("fp", fp), ("off", off)):
        orig = eng.runner.decode
        seen = logits.setdefault(name, [])
        eng.runner.decode = lambda seqs, orig=orig, seen=seen: seen.append(orig(seqs)) or seen[-1]
        eng.generate(UNEVEN, sp)
    assert all(torch.equal(a, b) for a, b in zip(logits["fp"], logits["off"])) and len(logits["fp"]) == 23


def test_a_pool_of_the_same_byte_budget_holds_correspondingly_more_tokens(tiny_models):
    folder, _ = tiny_models["llama"]
    model = load_model(folder)
    cfg = model.config
    budget = 4 << 20
    fp = Engine(model, block_size=16, max_batch=4, kv_budget_bytes=budget)
    assert fp.pool.nbytes <= budget
    for scheme in (KVScheme(8, 8, v_group=16), KVScheme(4, 4, v_group=16), KVScheme(4, 2, v_group=16)):
        q = Engine(model, block_size=16, max_batch=4, kv_budget_bytes=budget, kv_scheme=scheme)
        assert q.pool.nbytes <= budget  # the residual ring counted in
        per_fp = fp.pool.bytes_per_token
        assert per_fp == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
        assert q.pool.bytes_per_token == scheme.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        # the measured pool: every stored byte of a block divided by its tokens
        per_block = sum(t[:, 0].nbytes for k, t in q.pool.store.items() if k not in ("rk", "rv"))
        assert per_block / 16 == q.pool.bytes_per_token
        ratio = q.pool.capacity_tokens / fp.pool.capacity_tokens
        expect = (budget - q.pool.residual_nbytes) / budget * per_fp / q.pool.bytes_per_token
        assert abs(ratio - expect) < 0.02 * expect, (scheme.describe(), ratio, expect)
    # and the extra tokens are usable: a request the fp pool cannot hold runs in the KV4 pool
    small = 128 * fp.pool.bytes_per_token  # 128 fp32 tokens
    fp = Engine(model, block_size=16, max_batch=1, kv_budget_bytes=small)
    q4 = Engine(model, block_size=16, max_batch=1, kv_budget_bytes=small, kv_scheme=KVScheme(4, 4, v_group=16))
    assert fp.pool.capacity_tokens == 128 and q4.pool.capacity_tokens >= 4 * 112
    long = [2 + i % 120 for i in range(200)]
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with pytest.raises(Exception, match="KV tokens but the pool holds"):
        fp.generate([long], sp)
    assert len(q4.generate([long], sp)[0].output_ids) == 8


@pytest.mark.parametrize("scheme", SCHEMES + [KVScheme(4, 4, v_group=16, residual=32)], ids=lambda s: s.describe())
def test_prefill_writes_quantize_every_leaving_block_as_one_block_alone(scheme):
    """write_meta quantizes all rows' leaving blocks of a step in one call per codec; each block's codes and
    statistics must be those of quantizing that block's 16 tokens on their own (the reference), including
    blocks that were part in the ring before the step, and the ring must hold the rest exactly."""
    from qbench.engine.kv_cache import QuantKVPool
    from qbench.layers.attention import AttnMetadata
    bs, nkv, hd, nblk = 16, 2, 16, 5
    pool = QuantKVPool(1, 3 * nblk + 1, bs, nkv, hd, torch.float32, scheme, 3)
    layer = pool.layers[0]
    g = torch.Generator().manual_seed(5)
    tables = (torch.randperm(3 * nblk, generator=g) + 1).view(3, nblk)  # block 0 never used, as the engine's
    k_all, v_all = torch.randn(3, nblk * bs, nkv, hd, generator=g), torch.randn(3, nblk * bs, nkv, hd, generator=g)
    k_all[1, :, 0, 3] *= 40  # an outlier channel
    ctx = torch.zeros(3, dtype=torch.int64)
    for counts in ([5, 20, 33], [30, 7, 16], [1, 40, 0]):  # the second step finishes blocks the first began
        n = torch.tensor(counts)
        meta = AttnMetadata(positions=torch.zeros(3, 1, dtype=torch.int64), block_tables=tables,
                            context_lens=ctx + n, kv_slots=torch.arange(3), new_tokens=n)
        rows = [torch.arange(int(ctx[b]), int(ctx[b] + n[b])) for b in range(3)]
        layer.write_meta(meta, torch.cat([k_all[b, r] for b, r in enumerate(rows)]),
                         torch.cat([v_all[b, r] for b, r in enumerate(rows)]))
        ctx = ctx + n
    kcodec, vcodec = scheme.codecs()
    checked = 0
    for b in range(3):
        nq = layer.quantized_blocks(int(ctx[b]))
        for j in range(nq):
            blk = int(tables[b, j])
            for prefix, codec, x in (("k", kcodec, k_all), ("v", vcodec, v_all)):
                ref = codec.quantize(x[b, j * bs: (j + 1) * bs])
                assert torch.equal(layer.s[prefix + "c"][blk], ref.codes)
                if ref.scale is not None:
                    assert torch.equal(layer.s[prefix + "s"][blk], ref.scale)
                if ref.minimum is not None:
                    assert torch.equal(layer.s[prefix + "m"][blk], ref.minimum)
            checked += 1
        W = layer.windows
        for p in range(nq * bs, int(ctx[b])):  # the residual: exact
            assert torch.equal(layer.s["rk"][b, (p // bs) % W, p % bs], k_all[b, p]), (b, p, int(ctx[b]), nq)
            assert torch.equal(layer.s["rv"][b, (p // bs) % W, p % bs], v_all[b, p])
    assert checked >= 3, checked
