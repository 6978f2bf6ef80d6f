"""KV eviction (StreamingLLM, H2O, SnapKV): keep-sets against slow references, the engine against transformers
with the same tokens masked out, the budget invariant, blocks freed and reused, batched == sequential."""

import math

import pytest
import torch

from qbench.engine.engine import Engine
from qbench.engine.sampling import SamplingParams
from qbench.engine.scoring import log_softmax
from qbench.errors import QBenchError
from qbench.layers import eviction as ev
from qbench.layers.kvscheme import KVScheme
from qbench.models.registry import load_model
from qbench.quant.recipe import RecipeError, load_kv_scheme, recipe_from_dict

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
BS = 16


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 128, (n,), generator=g).tolist() for n in lengths]


# -- keep-sets on hand-built patterns, against slow loops ---------------------------------------------------------
def test_streaming_keeps_the_sinks_and_the_most_recent_tokens():
    keep = ev.streaming_keep(40, 12, 4, 2)
    assert keep.tolist() == [[0, 1, 2, 3] + list(range(32, 40))] * 2
    assert ev.streaming_keep(10, 12, 4, 1).tolist() == [list(range(10))]  # under budget: all of them


def _slow_scored_keep(scores, budget, recent):
    out = []
    for row in scores.tolist():
        n = len(row)
        tail = list(range(n - recent, n))
        heavy = sorted(range(n - recent), key=lambda i: (-row[i], i))[: budget - recent]
        out.append(sorted(heavy + tail))
    return out


def test_h2o_keeps_the_heavy_hitters_and_the_recent_window():
    torch.manual_seed(0)
    scores = torch.rand(3, 50, dtype=torch.float64)
    scores[0, 7] = 100.0  # a heavy hitter far from the window
    scores[1, 3] = scores[1, 9] = 0.5  # a tie: the earlier position wins, reproducibly
    keep = ev.scored_keep(scores, 20, 8)
    assert keep.tolist() == _slow_scored_keep(scores, 20, 8)
    assert 7 in keep[0].tolist() and keep.shape == (3, 20)


def test_snapkv_votes_pool_the_observation_windows_attention():
    probs = torch.zeros(2, 6, 30)  # (nkv, window queries, keys before the window)
    probs[0, :, 10] = 1.0  # head 0: every window query looks at key 10
    probs[1, 2, 29] = 1.0  # at the edge: the zeros past the end count in the average
    votes = ev.snapkv_votes(probs, 5)
    slow = torch.zeros(2, 30)
    summed = probs.sum(1)
    for h in range(2):
        for i in range(30):
            slow[h, i] = summed[h, max(0, i - 2): i + 3].sum() / 5
    assert torch.allclose(votes, slow, atol=1e-7)
    assert votes[0, 8:13].gt(1).all() and votes[0, 7] == 0  # the neighbourhood of key 10 is kept with it
    assert votes[1, 29] == pytest.approx(0.2)


def test_attention_probs_equal_a_per_query_softmax():
    torch.manual_seed(1)
    q, k = torch.randn(5, 4, 8), torch.randn(12, 2, 8)
    qpos = torch.tensor([3, 6, 7, 10, 11])
    p = ev.attention_probs(q, qpos, k, 0.35)  # (nkv, 5 * 2, 12)
    for i in range(5):
        for h in range(4):
            kv = h // 2
            logits = (k[: qpos[i] + 1, kv] @ q[i, h]) * 0.35
            ref = torch.softmax(logits, 0)
            row = p[kv, i * 2 + h % 2]
            assert torch.allclose(row[: qpos[i] + 1], ref, atol=1e-6) and row[qpos[i] + 1:].eq(0).all()


# -- the scheme and the recipes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, msg", [
    ({"scheme": "fp", "evict": "lru", "budget": 8}, "kv.evict: 'lru'"),
    ({"scheme": "fp", "evict": "h2o"}, "needs kv.budget"),
    ({"scheme": "fp", "evict": "h2o", "budget": 1.5}, "kv.budget: 1.5"),
    ({"scheme": "fp", "evict": "snapkv", "budget": 0.25, "pool": 4}, "kv.pool: 4"),
    ({"scheme": "fp", "budget": 64}, "needs an eviction policy"),
    ({"scheme": "fp", "evict": "streaming", "budget": True}, "kv.budget: True"),
])
def test_bad_eviction_settings_name_the_file_and_field(raw, msg):
    with pytest.raises(RecipeError, match=msg) as e:
        recipe_from_dict({"name": "x", "kv": raw}, "my.yaml")
    assert str(e.value).startswith("my.yaml: ")


@pytest.mark.parametrize("name, policy", [("kv-stream", "streaming"), ("kv-h2o", "h2o"), ("kv-snap", "snapkv"),
                                          ("kv4-snap", "snapkv"), ("kv-stream-10", "streaming"),
                                          ("kv-h2o-10", "h2o"), ("kv-snap-10", "snapkv")])
def test_shipped_eviction_recipes(name, policy):
    kv = load_kv_scheme(name)
    tenth = name.endswith("-10")
    assert kv.eviction.policy == policy and kv.eviction.budget == (0.1 if tenth else 0.25)
    assert kv.quantized == (name == "kv4-snap")
    assert kv.eviction.tokens(4096) == (410 if tenth else 1024) and kv.eviction.tokens(10) == (1 if tenth else 3)


# -- the engine ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_model(tiny_models["llama"][0])


def visible_streaming(n_prompt, n_new, budget, sinks):
    """The positions each decode query sees under StreamingLLM as the engine schedules it: evict to the budget at
    the end of the prefill, then whenever budget + one block is held."""
    kept = list(range(n_prompt))
    if len(kept) > budget:
        kept = kept[:sinks] + kept[len(kept) - (budget - sinks):]
    out = {}
    for p in range(n_prompt, n_prompt + n_new - 1):  # the last new token is sampled, never fed back
        kept.append(p)
        out[p] = list(kept)
        if len(kept) >= budget + BS:
            kept = kept[:sinks] + kept[len(kept) - (budget - sinks):]
    return out


def test_streaming_decode_equals_transformers_with_the_evicted_tokens_masked(tiny_models, llama, path):
    """Golden reference: each decode step's logits equal one transformers forward over the whole text in which
    each query row sees exactly the tokens the engine kept (a 4-d mask); RoPE keeps original positions. On the
    kernel path the compacted cache is read by the one-call decode step."""
    hf = tiny_models["llama"][1]
    prompt = prompts([70])[0]
    eng = Engine(llama, max_batch=2, kv_scheme=KVScheme(scheme="fp", evict="streaming", budget=24, sinks=4))
    eng.trace_logits = True
    seq = eng.generate([prompt], GREEDY)[0]
    assert eng.evictor.evictions >= 3 and eng.runner.fused == (path == "kernels")
    ids = prompt + seq.output_ids[:-1]
    T = len(ids)
    mask = torch.full((1, 1, T, T), float("-inf"))
    for i in range(len(prompt)):
        mask[0, 0, i, : i + 1] = 0
    vis = visible_streaming(len(prompt), len(seq.output_ids), 24, 4)
    for p, keys in vis.items():
        mask[0, 0, p, keys] = 0
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), attention_mask=mask).logits[0]
    got = {start: lg for start, lg in seq.trace}
    for p in vis:
        assert torch.allclose(got[p][0], ref[p], atol=2e-4, rtol=1e-4), p


def _hf_attentions(hf, ids):
    hf.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            return hf(torch.tensor([ids]), output_attentions=True).attentions  # per layer (1, nh, T, T)
    finally:
        hf.config._attn_implementation = "sdpa"


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_scores_and_keep_sets_at_the_end_of_prefill_equal_transformers_attention(tiny_models, llama, policy):
    """The scores the engine accumulates from its tapped queries equal transformers' eager attention
    probabilities (summed over the observation window or every query, and over each KV group's heads); the
    prefill-end keep-set is the policy's rule applied to those."""
    hf = tiny_models["llama"][1]
    prompt = prompts([60], seed=3)[0]
    kv = KVScheme(scheme="fp", evict=policy, budget=24, window=8)
    eng = Engine(llama, max_batch=1, kv_scheme=kv)
    seen = {}
    eng.generate([prompt], SamplingParams(max_new_tokens=1))  # builds the pool and its evictor
    evictor = eng.evictor
    keep_set, vote = evictor.keep_set, evictor._vote

    def spy_vote(seq):  # SnapKV's raw window sums, before its vote turns them into ranks
        seen["scores"] = evictor.scores[seq.seq_id].values.clone()
        vote(seq)

    def spy_keep(seq):  # the first keep-set is the prefill end's
        seen.setdefault("scores", evictor.scores[seq.seq_id].values.clone())
        seen.setdefault("keep", keep_set(seq))
        return keep_set(seq)

    evictor.keep_set, evictor._vote = spy_keep, spy_vote
    eng.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))
    atts = _hf_attentions(hf, prompt)
    n, W, nkv = len(prompt), 8, 2
    for layer, a in enumerate(atts):
        a = a[0].double()  # (nh, T, T)
        rows = a[:, n - W:] if policy == "snapkv" else a
        ref = rows.sum(1).view(nkv, 2, n).sum(1)  # (nkv, n): queries and group heads summed
        assert torch.allclose(seen["scores"][layer][:, :n] if policy == "h2o" else _votes_of(seen, layer, n, W),
                              ref if policy == "h2o" else _pooled(ref, n, W), atol=1e-5), layer
        want = (ev.scored_keep(ref, 24, 8) if policy == "h2o" else
                ev.rank_keep(torch.cat([_pooled(ref, n, W), torch.full((nkv, W), 1e30)], 1), 24))
        assert torch.equal(seen["keep"][layer], want), layer


def test_snapkv_votes_at_the_prompts_end_even_when_the_prompt_fits_its_budget(llama):
    """A prompt under its budget is not evicted at the prefill end, but the window still votes there: when the
    decode outgrows the budget, the prompt tokens go by their pooled votes, never by raw window sums."""
    kv = KVScheme(scheme="fp", evict="snapkv", budget=48, window=8)
    eng = Engine(llama, max_batch=1, kv_scheme=kv)
    eng.generate(prompts([10]), SamplingParams(max_new_tokens=1))
    evictor, seen = eng.evictor, {}
    vote = evictor._vote

    def spy(seq):
        raw = evictor.scores[seq.seq_id].values.clone()
        vote(seq)
        seen["raw"], seen["rank"] = raw, evictor.scores[seq.seq_id].values.clone()

    evictor._vote = spy
    eng.generate(prompts([40], seed=2), SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert evictor.evictions >= 1 and seen["rank"].shape[2] == 40
    for layer in range(llama.config.num_layers):
        assert torch.equal(seen["rank"][layer, :, :32], ev.snapkv_votes(seen["raw"][layer][:, None, :32], 5))
        assert bool((seen["rank"][layer, :, 32:] >= 1e30).all())


def _pooled(ref, n, W):
    return ev.snapkv_votes(ref[:, None, : n - W], 5)


def _votes_of(seen, layer, n, W):
    """SnapKV's pooled votes from the scores the spy saw (before the prefill-end rank replaced them)."""
    return ev.snapkv_votes(seen["scores"][layer][:, None, : n - W], 5)


@pytest.mark.parametrize("policy, bits", [("streaming", 16), ("h2o", 16), ("snapkv", 16), ("snapkv", 4),
                                          ("streaming", 8)])
def test_batched_equals_sequential_and_the_budget_holds(llama, policy, bits, path):
    kv = (KVScheme(scheme="fp", evict=policy, budget=0.25, window=8) if bits == 16 else
          KVScheme(k_bits=bits, v_bits=bits, v_group=16, residual=32, evict=policy, budget=0.25, window=8))
    ps = prompts([90, 45, 130, 70], seed=1)
    eng = Engine(llama, max_batch=4, kv_scheme=kv)
    worst = {}

    def watch(sched, step):  # before each step: no running sequence holds more than budget + one block
        for s in sched.running:
            if s.prefilled:
                b = eng.evictor.budget(s)
                worst[s.seq_id] = max(worst.get(s.seq_id, 0), s.kv_len)
                assert s.kv_len < b + BS and len(s.block_table) <= math.ceil(b / BS) + 1

    eng.observer = watch
    together = eng.generate(ps, GREEDY)
    assert eng.evictor.evictions > 0 and eng.blocks.num_free == eng.blocks.num_blocks
    for p, s in zip(ps, together):
        alone = Engine(llama, max_batch=4, kv_scheme=kv).generate([p], GREEDY)[0]
        assert alone.output_ids == s.output_ids


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv"])
def test_a_budget_that_covers_the_request_is_bit_identical_to_no_eviction(llama, policy):
    ps = prompts([50, 33])
    base = Engine(llama, max_batch=2, kv_scheme=KVScheme(scheme="fp"))
    base.trace_logits = True
    want = base.generate(ps, GREEDY)
    eng = Engine(llama, max_batch=2, kv_scheme=KVScheme(scheme="fp", evict=policy, budget=90))
    eng.trace_logits = True
    got = eng.generate(ps, GREEDY)
    assert eng.evictor.evictions == 0
    for a, b in zip(want, got):
        assert a.output_ids == b.output_ids
        assert all(torch.equal(x[1], y[1]) for x, y in zip(a.trace, b.trace))


def test_evicted_blocks_return_to_the_free_list_and_are_reused(llama):
    kv = KVScheme(scheme="fp", evict="streaming", budget=20)
    eng = Engine(llama, max_batch=1, kv_scheme=kv, kv_capacity_tokens=16 * 12)
    used = []
    eng.observer = lambda sched, step: used.append(eng.blocks.num_used)
    eng.generate(prompts([150]), SamplingParams(max_new_tokens=30, ignore_eos=True))
    # 150 prompt tokens take 10 blocks; after the prefill the request holds at most 3 (20 tokens + one block)
    assert max(used) == 10 and max(used[2:]) <= 3
    # the pool holds 12 blocks: two 150-token requests in turn fit only because the first gave its blocks back
    out = eng.generate(prompts([150, 140], seed=5), SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert all(len(s.output_ids) == 30 for s in out)


def test_footprints_and_the_pool_a_wave_needs():
    from qbench.engine.footprint import Footprint, footprint, pool_blocks
    snap = ev.Eviction("snapkv", 0.25)
    assert footprint(8160, 8192, 16) == Footprint(512, 512, False)  # no eviction: the whole reach
    assert footprint(8160, 8192, 16, ev.Eviction("snapkv", 8192)) == Footprint(512, 512, False)  # it covers it
    # 2,040 kept + one block: 129 blocks once the prefill is done; the 510-block prompt while it prefills
    assert footprint(8160, 8192, 16, snap) == Footprint(129, 510, True)
    assert footprint(100, 105, 16, ev.Eviction("streaming", 0.9)) == Footprint(7, 7, True)  # reach < budget + block
    assert pool_blocks([footprint(8160, 8192, 16, snap)] * 6, 4) == 4 * 129 + 381  # against 4 x 512 whole
    assert pool_blocks([Footprint(3, 9, True), Footprint(5, 5, False), Footprint(4, 4, False)], 2) == 9 + 6
    assert Footprint(4, 10, True).admitted(3) == 16 and Footprint(4, 10, True).admitted(1) == 10


@pytest.mark.parametrize("policy, bits", [("snapkv", 16), ("h2o", 16), ("streaming", 4)])
def test_the_pool_holds_the_budgets_and_one_prompt_and_gives_the_same_tokens(llama, policy, bits):
    """An evicting cache's pool holds each request's budget plus one block and one whole prompt, not every reach;
    the scheduler reserves at admission, so nothing is preempted and the tokens and logits are those of a pool that
    holds every request whole."""
    kv = (KVScheme(scheme="fp", evict=policy, budget=0.25, window=8) if bits == 16 else
          KVScheme(k_bits=bits, v_bits=bits, v_group=16, residual=16, evict=policy, budget=0.25))
    ps = prompts([160, 150, 170, 140, 155], seed=3)
    runs = {}
    for name, capacity, chunk in (("budget", None, 4096), ("whole", 52 * BS, 4096), ("chunked", None, 64)):
        eng = Engine(llama, max_batch=4, kv_scheme=kv, token_budget=chunk, kv_capacity_tokens=capacity)
        eng.trace_logits = True
        runs[name] = eng, eng.generate(ps, GREEDY)
    # 25% kept (40, 38, 43, 35, 39 tokens), + 40 new: at most 4 blocks each after the prefill (budget + one
    # block); the longest prompt takes 11 blocks, 7 beyond its 4. Every reach (180-210 tokens) whole: 52 blocks
    for name in ("budget", "chunked"):
        eng = runs[name][0]
        assert eng.pool.num_blocks == 4 * 4 + 7
        assert eng.stats.preemptions == 0 and eng.evictor.evictions >= 10
        assert eng.blocks.num_free == eng.blocks.num_blocks
    for a, b, c in zip(runs["whole"][1], runs["budget"][1], runs["chunked"][1]):
        assert a.output_ids == b.output_ids == c.output_ids
        # the small pool prefills one prompt at a time, the whole one four together: the same logits, bit for bit
        assert len(a.trace) == len(b.trace) and all(torch.equal(x[1], y[1]) for x, y in zip(a.trace, b.trace))


def test_parallel_samples_under_eviction_fit_a_pool_of_their_budgets(llama):
    kv = KVScheme(scheme="fp", evict="snapkv", budget=0.25, window=8)
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.9, seed=4)
    p = prompts([160], seed=9)[0]
    eng = Engine(llama, max_batch=4, kv_scheme=kv)
    got = eng.generate_n(p, sp, 3)
    assert eng.pool.num_blocks == 3 * 4 + 6  # three samples' budgets plus one block, and the 10-block prompt
    want = Engine(llama, max_batch=4, kv_scheme=kv, kv_capacity_tokens=64 * BS).generate_n(p, sp, 3)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert len({tuple(s.output_ids) for s in got}) > 1 and eng.blocks.num_free == eng.blocks.num_blocks


def test_an_evicting_request_neither_reads_nor_fills_the_prefix_cache(llama):
    """The rule: with the prefix cache on and a pool sized for the requests alone, an evicting request still
    evicts (its blocks are its own), caches nothing, and gives the same tokens as without the cache; a request
    that fits its budget uses the cache as before."""
    p = prompts([96], seed=7)[0]
    kv = KVScheme(scheme="fp", evict="streaming", budget=24)
    want = Engine(llama, max_batch=2, kv_scheme=kv).generate([p, p], GREEDY)
    eng = Engine(llama, max_batch=2, kv_scheme=kv, prefix_cache=True)
    got = eng.generate([p, p], GREEDY)
    assert eng.evictor.evictions >= 2 and eng.cache.cached_blocks == 0
    assert [s.output_ids for s in got] == [s.output_ids for s in want] and all(s.cached_tokens == 0 for s in got)
    fits = Engine(llama, max_batch=1, kv_scheme=KVScheme(scheme="fp", evict="streaming", budget=200),
                  prefix_cache=True)
    fits.generate([p], GREEDY)
    assert fits.generate([p + [5]], GREEDY)[0].cached_tokens == 96 and fits.evictor.evictions == 0


@pytest.mark.parametrize("case, msg", [
    ("window", "sliding window"),
    ("score", "needs the prompt's length"),
    ("prompt", "must leave at least one token"),
])
def test_eviction_refusals(tiny_models, llama, case, msg):
    kv = KVScheme(scheme="fp", evict="snapkv", budget=16)
    with pytest.raises(QBenchError, match=msg):
        if case == "window":
            Engine(load_model(tiny_models["mistral-window"][0]), kv_scheme=kv)
        else:
            Engine(llama, kv_scheme=kv).score(prompts([40]), prompt_len=40 if case == "prompt" else None)


# -- teacher-forced scoring under eviction ------------------------------------------------------------------------
@pytest.mark.parametrize("policy, bits", [("streaming", 16), ("h2o", 16), ("snapkv", 16), ("snapkv", 4)])
def test_scoring_under_eviction_equals_the_decode_steps_of_a_generation(llama, policy, bits, path):
    """Scoring a text under eviction runs its continuation as decode steps over the evicted cache: on the text a
    greedy generation produced, every scored row equals that generation's own decode logits, bit for bit, for
    two texts in one batch as for each alone."""
    kv = (KVScheme(scheme="fp", evict=policy, budget=0.25, window=8) if bits == 16 else
          KVScheme(k_bits=bits, v_bits=bits, v_group=16, residual=32, evict=policy, budget=0.25, window=8))
    ps = prompts([96, 96], seed=4)
    gen = Engine(llama, max_batch=2, kv_scheme=kv)
    gen.trace_logits = True
    seqs = [gen.generate([p], GREEDY)[0] for p in ps]
    assert gen.evictor.evictions >= 2 * 3
    texts = [p + s.output_ids[:-1] for p, s in zip(ps, seqs)]  # the last token is sampled, never fed
    eng = Engine(llama, max_batch=2, kv_scheme=kv)
    together = eng.score(texts, prompt_len=96)
    assert eng.evictor.evictions >= 2 * 3 and eng.blocks.num_free == eng.blocks.num_blocks
    assert eng.pool.num_blocks == 2 * 6  # the two 96-token prompts, then 24 kept + one block: not 135-token texts
    for text, s, lp in zip(texts, seqs, together):
        assert lp.shape == (len(text) - 95, llama.config.vocab_size)  # from the prompt's last position on
        want = {start: log_softmax(lg) for start, lg in s.trace}  # the engine's own log-probs of those logits
        for p in range(96, len(text)):
            assert torch.equal(lp[p - 95], want[p][0]), p
        # the prompt's last row: its prefill, before any eviction (the head on that one row here, on every row
        # in the traced generation: equal to float32 rounding)
        assert torch.allclose(lp[0], want[0][95], atol=1e-5, rtol=0)
        alone = Engine(llama, max_batch=2, kv_scheme=kv).score([text], prompt_len=96)[0]
        assert torch.equal(alone, lp)


def test_streaming_scores_equal_transformers_with_the_evicted_tokens_masked(tiny_models, llama):
    """Golden reference for the scored rows: one transformers forward in which each row past the prompt sees
    exactly what StreamingLLM kept (sinks, then the recent tokens, evicted at budget + one block)."""
    hf = tiny_models["llama"][1]
    text = prompts([110], seed=9)[0]
    eng = Engine(llama, max_batch=1, kv_scheme=KVScheme(scheme="fp", evict="streaming", budget=24, sinks=4))
    lp = eng.score([text], prompt_len=60)[0]
    T = len(text)
    mask = torch.full((1, 1, T, T), float("-inf"))
    for i in range(60):
        mask[0, 0, i, : i + 1] = 0
    vis = visible_streaming(60, T - 60 + 1, 24, 4)
    assert sorted(vis) == list(range(60, T))
    for p, keys in vis.items():
        mask[0, 0, p, keys] = 0
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([text]), attention_mask=mask).logits[0], dim=-1)
    assert torch.allclose(lp, ref[59:], atol=2e-4, rtol=1e-4)  # rows from the prompt's last position on
    full = Engine(llama, max_batch=1).score([text])[0]
    assert full.shape[0] == T  # without a prompt, every position
    assert not torch.allclose(lp[70 - 59:], full[70:], atol=1e-2)  # eviction changed what the scored rows saw


def test_a_budget_that_covers_the_text_scores_as_one_prefill(llama):
    text = prompts([80], seed=2)[0]
    want = Engine(llama, max_batch=1).score([text])[0]
    for budget in (80, 1.0):
        eng = Engine(llama, max_batch=1, kv_scheme=KVScheme(scheme="fp", evict="h2o", budget=budget))
        if budget == 80:
            assert torch.equal(eng.score([text], prompt_len=40)[0], want[39:])
        else:
            assert torch.equal(eng.score([text])[0], want)


@pytest.mark.parametrize("bits", [8, 4])
def test_compacting_a_quantized_pool_keeps_each_kept_token(bits):
    """Evict, then store again: tokens that were in quantized blocks come back within their new blocks' rounding,
    tokens that stay in the full-precision ring come back exactly, each head its own keep-set."""
    from qbench.engine.kv_cache import QuantKVPool
    torch.manual_seed(0)
    L, nkv, hd, n = 2, 2, 32, 75
    pool = QuantKVPool(L, 12, BS, nkv, hd, torch.float32, KVScheme(k_bits=bits, v_bits=bits, residual=32), 2)
    k, v = torch.randn(L, n, nkv, hd), torch.randn(L, n, nkv, hd)
    table = list(range(5))
    for i in range(L):
        pool.layers[i].store_sequence(table, k[i], v[i], 1)
    got0 = pool.read_sequence(0, table, n, 1)
    assert torch.equal(got0[0][64:], k[0, 64:])  # the ring (the last 32 tokens' blocks) is exact
    g = torch.Generator().manual_seed(1)
    keep = torch.stack([torch.sort(torch.randperm(n, generator=g)[:40]).values for _ in range(L * nkv)]).view(L, nkv, 40)
    before = [pool.read_sequence(i, table, n, 1) for i in range(L)]
    pool.compact(table, keep, [7, 3, 9], n, 1)
    step = {8: 0.05, 4: 0.8}[bits]
    for i in range(L):
        after = pool.read_sequence(i, [7, 3, 9], 40, 1)
        for h in range(nkv):
            for was, now in zip(before[i], after):
                want = was[keep[i, h], h]  # (40, hd)
                assert (now[:, h] - want).abs().max() < step
                assert torch.equal(now[32:, h], want[32:])  # kept tokens now in the ring: not rounded again


SCORED = """name: evicted-kld
seed: 3
batch_size: 2
tasks:
  kld: {data: evals/data/wikitext-2-raw/wiki.test.raw, ctx: 192, chunks: 2, top_k: 32, exact_chunks: 1}
  perplexity: {data: evals/data/wikitext-2-raw/wiki.test.raw, ctx: 192, chunks: 2, rolling_docs: 1,
               rolling_len: 256, top_k: 32, exact_chunks: 1}
"""


def test_kld_and_perplexity_under_eviction_against_a_baseline_without(smollm2, tmp_path):
    """qbench eval --kv with eviction scores against an fp-cache baseline: a quarter of each window's first half
    kept costs KL (StreamingLLM more than a budget that covers the window, which costs exactly none), and
    the rolling perplexity, which has no prompt to compress, says it was skipped."""
    from conftest import SMOL
    from qbench.evals.run import run_eval
    suite = tmp_path / "s.yaml"
    suite.write_text(SCORED)
    covers = tmp_path / "covers.yaml"
    covers.write_text("name: covers\nkv: {scheme: fp, evict: streaming, budget: 400}\n")
    quiet = dict(log=lambda m: None)
    run_eval(SMOL, str(suite), tmp_path / "fp", **quiet)
    got = {kv: run_eval(SMOL, str(suite), tmp_path / f"run-{i}", baseline=tmp_path / "fp", kv=kv, **quiet)
           for i, kv in enumerate(("kv-stream", str(covers)))}
    stream, full = got["kv-stream"]["tasks"], got[str(covers)]["tasks"]
    assert full["kld"]["score"] == 0.0 and "word_perplexity" in full["perplexity"]["lm_eval_rolling"]
    assert stream["kld"]["score"] > 0.01 and stream["kld"]["kld"]["mean"] > 5 * stream["kld"]["kld"]["se"]
    assert "skipped" in stream["perplexity"]["lm_eval_rolling"]
    assert stream["perplexity"]["vs_baseline"]["ppl_ratio"] > 1.0


def test_the_kvpress_cross_check_runs_its_qbench_side(tmp_path, smollm2):
    """scripts/kvpress_check.py's qbench side (kvpress itself needs its own virtualenv): the keep-set it records
    is the one the prefill's eviction kept, for every layer and KV head, and the answer is scored."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).parents[1] / "scripts" / "kvpress_check.py"
    spec = importlib.util.spec_from_file_location("kvpress_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "check.json"
    mod.run_qbench(str(smollm2), str(out), lengths=(256,), depths=(50,), samples=1, new=2)
    (item,) = json.loads(out.read_text())["items"]
    n = len(item["ids"])
    for policy in mod.POLICIES:
        keep = item["qbench"][policy]["keep"]  # (layers, kv heads, kept)
        assert len(keep) == 30 and all(len(h) == 3 for h in keep)
        assert all(len(k) == int(n * (1 - mod.RATIO)) and k == sorted(set(k)) for h in keep for k in h)
        assert item["qbench"][policy]["score"] in (0.0, 1.0)
    streaming = item["qbench"]["streaming"]["keep"][0][0]
    assert streaming[:4] == [0, 1, 2, 3] and streaming[-1] == n - 1  # sinks and the most recent token
