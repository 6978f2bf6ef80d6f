"""Block sharing: reference counts and copy-on-write, the radix-tree prefix cache, parallel sampling."""

import pytest
import torch

from qbench.engine.block_manager import BlockManager
from qbench.engine.engine import Engine
from qbench.engine.radix import RadixCache
from qbench.engine.sampling import SamplingParams
from qbench.engine.sequence import Sequence
from qbench.layers.kvscheme import KVScheme
from qbench.models.registry import load_model

SP = SamplingParams()


def seq(tokens, cached=0):
    s = Sequence(list(tokens), SP)
    s.num_cached = cached
    return s


class Copies:
    def __init__(self):
        self.calls = []

    def __call__(self, src, dst):
        self.calls.append((src, dst))


def test_fork_shares_blocks_and_only_the_first_writer_copies_a_shared_partial_block():
    copies = Copies()
    bm = BlockManager(16, 4, copies)
    parent = seq(range(10), cached=10)
    bm.reserve(parent, 10)  # 3 blocks, the last one partial (2 of 4 tokens)
    kids = [seq(range(10)) for _ in range(2)]
    for k in kids:
        bm.fork(parent, k)
    assert [bm.ref_count[b] for b in parent.block_table] == [3, 3, 3]
    assert bm.num_used == 3  # three sequences of 10 tokens in 3 blocks, not 9
    last = parent.block_table[2]
    bm.prepare_write(parent, 11)  # first writer into the shared partial block: copies it
    assert copies.calls == [(last, parent.block_table[2])] and parent.block_table[2] != last
    assert bm.ref_count[last] == 2
    bm.prepare_write(kids[0], 11)  # second writer: still shared with kids[1], copies
    assert len(copies.calls) == 2 and bm.ref_count[last] == 1
    bm.prepare_write(kids[1], 11)  # the last holder writes in place
    assert len(copies.calls) == 2 and kids[1].block_table[2] == last
    # full blocks stay shared; writing past them allocates at the boundary only
    assert bm.ref_count[parent.block_table[0]] == 3
    for s in [parent] + kids:
        s.num_cached = 12
        bm.prepare_write(s, 13)
    assert bm.copies == 2 and all(len(s.block_table) == 4 for s in [parent] + kids)
    for s in [parent] + kids:
        bm.release(s)
    assert bm.num_free == 16 and sum(bm.ref_count) == 0


def test_a_write_that_starts_a_new_block_never_copies():
    copies = Copies()
    bm = BlockManager(8, 4, copies)
    a = seq(range(8), cached=8)
    bm.reserve(a, 8)
    b = seq(range(8))
    bm.fork(a, b)
    bm.prepare_write(a, 9)
    bm.prepare_write(b, 9)
    assert copies.calls == [] and a.block_table[:2] == b.block_table[:2] and a.block_table[2] != b.block_table[2]


def cache_with(num_blocks=32, bs=4):
    bm = BlockManager(num_blocks, bs, Copies())
    return bm, RadixCache(bm)


def put(bm, cache, tokens, salt=""):
    s = seq(tokens, cached=len(tokens))
    bm.reserve(s, len(tokens))
    cache.insert(tokens, s.block_table, salt)
    blocks = list(s.block_table)
    bm.release(s)  # the request ends; the cache keeps its own reference
    return blocks


def test_longest_prefix_match_is_block_granular_and_splits_an_edge_where_a_lookup_diverges():
    bm, cache = cache_with()
    blocks = put(bm, cache, list(range(12)))  # one edge of 3 blocks
    root = cache.roots[""]
    assert len(root.children) == 1 and len(next(iter(root.children.values())).blocks) == 3
    # diverges inside block 2 (token 9): two whole blocks match, and the edge splits after them
    node, got = cache.match([0, 1, 2, 3, 4, 5, 6, 7, 8, 99, 10, 11])
    assert got == blocks[:2]
    upper = next(iter(root.children.values()))
    assert upper.key == tuple(range(8)) and upper.blocks == blocks[:2] and node is upper
    (lower,) = upper.children.values()
    assert lower.key == (8, 9, 10, 11) and lower.blocks == blocks[2:]
    cache.unlock(node)
    # a partial block never matches: 7 tokens hit 1 block, 3 tokens hit none
    assert cache.match(list(range(7)))[1] == blocks[:1]
    assert cache.match([0, 1, 2])[1] == []
    # a second branch after the split point; the shared blocks are held once
    before = bm.num_used
    put(bm, cache, list(range(8)) + [50, 51, 52, 53])
    assert bm.num_used == before + 1 and len(upper.children) == 2


def test_pinned_nodes_are_never_evicted_and_lru_takes_leaves_then_their_parents():
    bm, cache = cache_with(num_blocks=12)
    a = put(bm, cache, list(range(8)))  # node A, 2 blocks
    b = put(bm, cache, list(range(8)) + [20, 21, 22, 23])  # node B, A's child, 1 block
    c = put(bm, cache, [30, 31, 32, 33])  # node C, 1 block
    node, _ = cache.match(list(range(8)) + [20, 21, 22, 23])  # a running request pins B and A
    assert cache.evict(10) == 1  # only C is unpinned
    assert (bm.ref_count[a[0]], bm.ref_count[b[2]], bm.ref_count[c[0]]) == (1, 1, 0)  # b[:2] were a's
    cache.unlock(node)
    # B, a leaf, goes first; A becomes a leaf once B is gone and goes in the same call
    assert cache.evict(2) == 3
    assert bm.num_free == 12 and cache.cached_blocks == 0


def test_lru_order_among_unpinned_leaves():
    bm, cache = cache_with(num_blocks=8)
    x = put(bm, cache, [1, 1, 1, 1])
    y = put(bm, cache, [2, 2, 2, 2])
    cache.unlock(cache.match([1, 1, 1, 1])[0])  # x is now more recent than y
    assert cache.evict(1) == 1
    assert bm.ref_count[y[0]] == 0 and bm.ref_count[x[0]] == 1


def test_a_cache_salt_keeps_tenants_apart():
    bm, cache = cache_with()
    put(bm, cache, list(range(8)), salt="tenant-a")
    assert cache.match(list(range(8)) + [1], "tenant-b")[1] == []
    assert len(cache.match(list(range(8)) + [1], "tenant-a")[1]) == 2


# -- the engine ------------------------------------------------------------------------------------

SHARED = list(range(3, 40))  # 37 tokens: 9 whole blocks of 4 and one token


def prompts():
    return [SHARED + [50 + i, 60 + i, 70 + i] for i in range(4)] + [list(range(100, 113))]


@pytest.mark.parametrize("scheme", [None, KVScheme(4, 4, group=4, v_group=8, residual=4)],
                         ids=["fp", "k4v4"])
def test_prefix_cache_gives_identical_results_and_computes_a_shared_prefix_once(tiny_models, scheme):
    folder, _ = tiny_models["llama"]
    model = load_model(folder)
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    plain = Engine(model, block_size=4, kv_scheme=scheme)
    cached = Engine(model, block_size=4, kv_scheme=scheme, prefix_cache=True)
    assert cached.cache is None and cached.prefix_cache  # built with the pool
    a = [s.output_ids for s in plain.generate(prompts(), sp)]
    b = [s.output_ids for s in cached.generate(prompts(), sp)]
    assert a == b
    # the 36-token shared prefix (9 blocks) was computed once: 4 prompts of 40 and one of 13
    assert plain.stats.computed_prefill_tokens == 4 * 40 + 13
    assert cached.stats.cached_tokens == 3 * 36
    assert cached.stats.computed_prefill_tokens == 4 * 40 + 13 - 3 * 36
    # a second call finds every prompt's whole blocks in the cache
    cached.reset_stats()
    assert [s.output_ids for s in cached.generate(prompts(), sp)] == a
    assert cached.stats.cached_tokens == 4 * 36 + 12  # the last token is always computed: 39 -> 9 blocks


def test_a_quantized_cache_with_a_longer_residual_window_keeps_the_prefix_cache_off(tiny_models):
    folder, _ = tiny_models["llama"]
    eng = Engine(load_model(folder), block_size=4, kv_scheme=KVScheme(4, 4, group=4, v_group=8, residual=8),
                 prefix_cache=True)
    assert not eng.prefix_cache and "residual window" in eng.prefix_cache_note


@pytest.mark.parametrize("scheme", [None, KVScheme(8, 8, group=4, v_group=8, residual=4)], ids=["fp", "k8v8"])
def test_parallel_sampling_shares_the_prompt_blocks(tiny_models, scheme):
    folder, _ = tiny_models["llama"]
    model = load_model(folder)
    prompt = list(range(2, 32))  # 30 tokens: 7 whole blocks and a partial one
    sp = SamplingParams(temperature=1.0, max_new_tokens=5, seed=11, ignore_eos=True)
    eng = Engine(model, block_size=4, kv_scheme=scheme)
    peak = []
    eng.observer = lambda sched, step: peak.append(eng.blocks.num_used)
    outs = eng.generate_n(prompt, sp, 4)
    assert len(outs) == 4 and len({tuple(s.output_ids) for s in outs}) > 1
    # each sample equals the same prompt run alone with its own seed
    alone = Engine(model, block_size=4, kv_scheme=scheme)
    for i, s in enumerate(outs):
        from dataclasses import replace
        ref = alone.generate([prompt], replace(sp, seed=11 + i))[0]
        assert s.output_ids == ref.output_ids
    assert eng.stats.computed_prefill_tokens == 30  # the prompt was prefilled once
    # memory: 8 prompt blocks shared by 4 samples; each sample copied the partial block once and grew 1 block
    shared_peak = max(peak)
    unshared = 4 * eng.blocks.blocks_for(30 + 5)
    assert shared_peak == 7 + 4 * 2 and shared_peak < unshared
    assert eng.blocks.copies == 3  # the fourth writer owned the block alone


def test_chunked_prefill_equals_one_prefill(tiny_models):
    folder, _ = tiny_models["llama"]
    model = load_model(folder)
    sp = SamplingParams(max_new_tokens=5, ignore_eos=True)
    big = Engine(model, block_size=4, token_budget=4096)
    small = Engine(model, block_size=4, token_budget=8, max_batch=4)
    steps = []
    small.observer = lambda sched, step: steps.append(step.describe())
    a = [s.output_ids for s in big.generate(prompts(), sp)]
    b = [s.output_ids for s in small.generate(prompts(), sp)]
    assert a == b
    assert max(sum(n for _, n in st["prefill"]) + len(st["decode"]) for st in steps) <= 8
    assert any(n < 40 for st in steps for _, n in st["prefill"])  # prompts really were chunked


def test_cache_survives_a_pool_that_grows(tiny_models):
    folder, _ = tiny_models["llama"]
    eng = Engine(load_model(folder), block_size=4, prefix_cache=True)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
    first = eng.generate([SHARED], sp)[0].output_ids
    blocks = eng.pool.num_blocks
    eng.generate([[2 + i % 90 for i in range(200)]], sp)  # needs a bigger pool
    assert eng.pool.num_blocks > blocks
    eng.reset_stats()
    assert eng.generate([SHARED], sp)[0].output_ids == first
    assert eng.stats.cached_tokens == 36


def test_evicted_blocks_are_reused_when_the_pool_is_full(tiny_models):
    folder, _ = tiny_models["llama"]
    eng = Engine(load_model(folder), block_size=4, prefix_cache=True, kv_capacity_tokens=64)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
    outs = [eng.generate([[7 + i] * 30 + list(range(30))], sp)[0].output_ids for i in range(6)]
    assert eng.cache.evicted_blocks > 0  # each request fills most of the pool; older prefixes made room
    again = Engine(load_model(folder), block_size=4)
    assert outs == [again.generate([[7 + i] * 30 + list(range(30))], sp)[0].output_ids for i in range(6)]
    assert torch.equal(torch.tensor(sorted(list(eng.blocks.free_blocks) + [b for n in eng.cache._nodes()
                                                                      for b in n.blocks])),
                       torch.arange(eng.blocks.num_blocks))  # no block leaked


@pytest.mark.skipif(not __import__("qbench.kernels.build", fromlist=["x"]).available(),
                    reason="the fixed-order prefill attention is a native kernel")
def test_a_prefix_cache_hit_gives_the_bits_of_a_whole_prompt_prefill(tiny_models):
    """Over an fp32 pool the fixed-order prefill attention reads a prompt's cached blocks and its new keys in one
    pass, in the order a whole-prompt prefill reads them, and every projection computes a row on its own: so a
    prompt whose prefix came from the cache gets the logits of a fresh prefill, bit for bit (torch's flash path
    merged two calls and agreed only to rounding)."""
    model = load_model(tiny_models["llama"][0])
    sp = SamplingParams(max_new_tokens=1, ignore_eos=True)
    prompt = SHARED + [50, 60, 70]
    warm = Engine(model, block_size=4, prefix_cache=True)
    warm.generate([SHARED + [90, 91]], sp)
    warm.reset_stats()
    warm.trace_logits = True
    hit = warm.generate([prompt], sp)[0]
    assert warm.stats.cached_tokens == 36
    cold = Engine(model, block_size=4)
    cold.trace_logits = True
    fresh = cold.generate([prompt], sp)[0]
    (start, rows), (fstart, frows) = hit.trace[0], fresh.trace[0]
    assert start == 36 and fstart == 0 and rows.shape[0] == len(prompt) - 36
    assert torch.equal(rows, frows[start:])
