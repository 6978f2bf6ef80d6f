"""qb_attention_kv: decode attention that reads quantized, FP8, fp16 and bf16 KV blocks in place, held against
the slow path (dequantize the whole cache, then torch's SDPA with a dense mask)."""

import pytest
import torch
import torch.nn.functional as F

from qbench.engine.engine import Engine
from qbench.engine.kv_cache import KVPool, QuantKVPool
from qbench.engine.sampling import SamplingParams
from qbench.kernels import build, ops
from qbench.layers.attention import AttnMetadata, build_mask
from qbench.layers.kv import QuantBlockKV
from qbench.layers.kvscheme import KVScheme
from qbench.models.registry import load_model
from conftest import native_isas

needs_kernel = pytest.mark.skipif(not build.available(), reason="no native kernels on this machine")
BS = 16


def reference(q, keys, values, meta, window, scale):
    """q (B, 1, nh, hd); keys/values (B, nkv, L, hd) in full precision -> (B, 1, nh * hd) through SDPA."""
    B, T, nh, hd = q.shape
    nkv = keys.shape[1]
    g = nh // nkv
    mask = build_mask(meta, g, window)
    qg = q.view(B, T, nkv, g, hd).permute(0, 2, 1, 3, 4).reshape(B, nkv, T * g, hd)
    out = F.scaled_dot_product_attention(qg, keys.float(), values.float(), attn_mask=mask, scale=scale)
    return out.view(B, nkv, T, g, hd).permute(0, 2, 1, 3, 4).reshape(B, T, nh * hd)


class Batch:
    """B sequences in one pool: block tables, residual slots and the metadata of each step."""

    def __init__(self, lens, nblk):
        self.lens = list(lens)
        B = len(lens)
        self.tables = torch.arange(B * nblk, dtype=torch.int64).view(B, nblk).flip(1).contiguous()  # scattered
        self.slots = torch.arange(B, dtype=torch.int64)

    def write_tokens(self, layer, nkv, hd, gen):
        """Every row's keys and values written one position at a time at its slots (an fp16/bf16 pool's write)."""
        for i in range(max(self.lens)):
            rows = [r for r, n in enumerate(self.lens) if i < n]
            slots = torch.tensor([int(self.tables[r, i // BS]) * BS + i % BS for r in rows])
            layer.write(slots, *kv_like(len(rows), nkv, hd, gen))

    def meta(self, new):
        """Metadata once ``new`` tokens per row are written (prefill: the rows' whole lengths)."""
        ctx = torch.tensor(self.lens, dtype=torch.int64)
        positions = (ctx - 1)[:, None]  # the last token of each row queries
        return AttnMetadata(positions=positions, slot_mapping=torch.zeros(1, dtype=torch.int64),
                            block_tables=self.tables, context_lens=ctx, block_size=BS, kv_slots=self.slots,
                            new_tokens=torch.tensor(new, dtype=torch.int64))


def kv_like(n, nkv, hd, gen):
    """Keys with per-channel outliers (what KIVI's per-channel K is for) and plain values."""
    k = torch.randn(n, nkv, hd, generator=gen) * (1 + 4 * torch.rand(nkv, hd, generator=gen))
    return k, torch.randn(n, nkv, hd, generator=gen)


SCHEMES = [KVScheme(8, 8), KVScheme(4, 4), KVScheme(2, 2), KVScheme(4, 2), KVScheme(2, 8),
           KVScheme(8, 8, scheme="fp8"), KVScheme(16, 4), KVScheme(4, 16), KVScheme(4, 4, residual=48),
           KVScheme(2, 2, v_group=64), KVScheme(4, 4, residual=32), KVScheme(8, 4, v_group=64)]


@needs_kernel
@pytest.mark.parametrize("hd, nh, nkv", [(64, 6, 2), (64, 14, 2), (128, 4, 4), (32, 8, 2), (64, 8, 4)])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.describe())
def test_quantized_blocks_read_in_place_match_dequantize_then_attend(scheme, hd, nh, nkv):
    """Rows of 5 to 70 tokens, ten decode steps across block boundaries: every step's output equals the
    dequantize-everything reference, for every bit width, FP8, a full-precision K or V, longer residual
    windows and a sliding window."""
    if hd % scheme.v_group:
        pytest.skip(f"V groups of {scheme.v_group} channels need a head_dim they divide")
    pool = QuantKVPool(1, 64, BS, nkv, hd, torch.float32, scheme, max_seqs=4)
    layer = pool.layers[0]
    if not layer.decode_kernel:
        assert not ops.kv_kernel_fits(hd, layer.sources())  # only a layout the kernel does not take skips it
        pytest.skip(f"{scheme.describe()} at head_dim {hd}: not a layout qb_attention_kv takes")
    gen = torch.Generator().manual_seed(hd + nh)
    b = Batch([5, 37, 70, 16], nblk=8)
    k, v = kv_like(sum(b.lens), nkv, hd, gen)
    layer.write_meta(b.meta(b.lens), k, v)
    scale = hd ** -0.5
    for step in range(10):
        b.lens = [n + 1 for n in b.lens]
        meta = b.meta([1] * len(b.lens))
        k, v = kv_like(len(b.lens), nkv, hd, gen)
        layer.write_meta(meta, k, v)
        q = torch.randn(len(b.lens), 1, nh, hd, generator=gen)
        for window in (None, 24):
            got = layer.attend_decode(q, meta, window, scale)
            keys, values = layer.read_meta(meta)
            want = reference(q, keys, values, meta, window, scale)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"step {step}, window {window}")


ISA_SCHEMES = [KVScheme(4, 4), KVScheme(8, 8), KVScheme(2, 2), KVScheme(4, 2), KVScheme(2, 2, v_group=64),
               KVScheme(8, 8, scheme="fp8"), KVScheme(16, 4), KVScheme(4, 16), KVScheme(4, 4, residual=48)]


def attend_each_isa(fn):
    """fn() once per native instruction-set path (qb_set_isa), the dispatch restored after."""
    lib, isas = build.load(), native_isas()
    try:
        outs = []
        for isa in isas:
            lib.qb_set_isa(isa)
            outs.append(fn())
        return outs
    finally:
        lib.qb_set_isa(isas[-1])


needs_two_isas = pytest.mark.skipif(len(native_isas()) < 2, reason="one instruction-set path on this CPU (AVX2 only)")


@needs_kernel
@needs_two_isas
@pytest.mark.parametrize("hd, nh, nkv", [(64, 9, 3), (64, 14, 2), (128, 12, 1), (40, 6, 2), (32, 4, 4), (64, 8, 4)])
@pytest.mark.parametrize("scheme", ISA_SCHEMES, ids=lambda s: s.describe())
def test_the_avx512_path_reads_quantized_blocks_to_the_avx2_bits(scheme, hd, nh, nkv):
    """The AVX-512 helpers keep the AVX2 helpers' order of every sum: the same bits on every layout, group of
    query heads (up to 12 a KV head, so two register passes), head_dim with a half-zmm tail (40), windows, and
    rows that end mid-block."""
    if hd % scheme.v_group and scheme.v_bits < 16 and scheme.scheme == "kivi":
        pytest.skip(f"V groups of {scheme.v_group} channels need a head_dim they divide")
    pool = QuantKVPool(1, 64, BS, nkv, hd, torch.float32, scheme, max_seqs=4)
    layer = pool.layers[0]
    if not layer.decode_kernel:
        pytest.skip(f"{scheme.describe()} at head_dim {hd}: not a layout qb_attention_kv takes")
    gen = torch.Generator().manual_seed(hd * nh)
    b = Batch([5, 37, 70, 16], nblk=8)
    layer.write_meta(b.meta(b.lens), *kv_like(sum(b.lens), nkv, hd, gen))
    for step in range(3):
        b.lens = [n + 1 for n in b.lens]
        meta = b.meta([1] * len(b.lens))
        layer.write_meta(meta, *kv_like(len(b.lens), nkv, hd, gen))
        q = torch.randn(len(b.lens), 1, nh, hd, generator=gen)
        for window in (None, 24):
            outs = attend_each_isa(lambda: layer.attend_decode(q, meta, window, hd ** -0.5))
            assert all(torch.equal(outs[0], o) for o in outs[1:]), (step, window)


@needs_kernel
@needs_two_isas
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hd, nh, nkv", [(64, 9, 3), (40, 12, 1), (128, 4, 2)])
def test_the_avx512_path_reads_an_fp16_or_bf16_pool_to_the_avx2_bits(dtype, hd, nh, nkv):
    pool = KVPool(1, 32, BS, nkv, hd, dtype)
    layer = pool.layers[0]
    gen = torch.Generator().manual_seed(hd)
    b = Batch([3, 40, 65], nblk=6)
    b.write_tokens(layer, nkv, hd, gen)
    meta = b.meta([1] * 3)
    q = torch.randn(3, 1, nh, hd, generator=gen)
    k_src, v_src = layer.sources()
    for window in (None, 16):
        outs = attend_each_isa(lambda: ops.attention_kv(q, meta.block_tables, meta.positions, None, meta.context_lens,
                                                        k_src, v_src, window=window, scale=0.125))
        assert all(torch.equal(outs[0], o) for o in outs[1:]), window


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_fp16_or_bf16_pool_is_read_as_stored(dtype):
    nkv, hd, nh = 2, 64, 6
    pool = KVPool(1, 32, BS, nkv, hd, dtype)
    layer = pool.layers[0]
    assert layer.native
    gen = torch.Generator().manual_seed(0)
    b = Batch([3, 40, 65], nblk=6)
    b.write_tokens(layer, nkv, hd, gen)
    meta = b.meta([1] * 3)
    q = torch.randn(3, 1, nh, hd, generator=gen)
    for window in (None, 16):
        k_src, v_src = layer.sources()
        got = ops.attention_kv(q, meta.block_tables, meta.positions, None, meta.context_lens, k_src, v_src,
                               window=window, scale=0.125)
        keys, values = layer.read(meta.block_tables)
        torch.testing.assert_close(got, reference(q, keys, values, meta, window, 0.125), rtol=1e-4, atol=1e-5)


@needs_kernel
def test_a_padded_query_row_gets_zeros_and_leaves_the_others_alone():
    scheme = KVScheme(4, 4)
    pool = QuantKVPool(1, 32, BS, 2, 64, torch.float32, scheme, max_seqs=2)
    layer = pool.layers[0]
    gen = torch.Generator().manual_seed(1)
    b = Batch([20, 33], nblk=4)
    layer.write_meta(b.meta(b.lens), *kv_like(53, 2, 64, gen))
    meta = b.meta([0, 0])
    q = torch.randn(2, 1, 4, 64, generator=gen)
    full = layer.attend_decode(q, meta, None, 0.125)
    meta.query_valid = torch.tensor([[True], [False]])
    part = layer.attend_decode(q, meta, None, 0.125)
    assert torch.equal(part[0], full[0]) and not part[1].any()


LONG = [5, 37, 600, 1100]  # 1, 1, 2 and 3 segments of value sums (32 blocks of 16 tokens each)


def long_rows(scheme, hd, nkv, gen):
    """LONG's rows written into one pool (quantized, or an fp16 one), one decode token each after the prompt;
    -> (attend(q, rows, window), metadata of all rows). ``attend`` reads only the given rows (a batch of them)."""
    nblk = max(LONG) // BS + 2
    b = Batch(LONG, nblk=nblk)
    if scheme == "fp16":
        layer = KVPool(1, len(LONG) * nblk + 1, BS, nkv, hd, torch.float16).layers[0]
        b.write_tokens(layer, nkv, hd, gen)
        srcs, rings = layer.sources(), (None, None)
    else:
        layer = QuantKVPool(1, len(LONG) * nblk + 1, BS, nkv, hd, torch.float32, scheme, max_seqs=len(LONG)).layers[0]
        layer.write_meta(b.meta(b.lens), *kv_like(sum(b.lens), nkv, hd, gen))
        b.lens = [n + 1 for n in b.lens]
        layer.write_meta(b.meta([1] * len(LONG)), *kv_like(len(LONG), nkv, hd, gen))
        srcs, rings = layer._sources, (layer.s["rk"], layer.s["rv"])
    meta = b.meta([1] * len(LONG))

    def attend(q, rows, window=None):
        r = torch.tensor(rows)
        return ops.attention_kv(q[r], meta.block_tables[r], meta.positions[r], None, meta.context_lens[r], *srcs,
                                *rings, None if rings[0] is None else meta.kv_slots[r], window=window, scale=0.125)
    return attend, meta, layer


@needs_kernel
@pytest.mark.parametrize("hd, nh, nkv", [(64, 9, 3), (64, 14, 2), (32, 8, 4)])
@pytest.mark.parametrize("scheme", [KVScheme(8, 8), KVScheme(4, 2), KVScheme(8, 8, scheme="fp8"), KVScheme(16, 4),
                                    KVScheme(4, 4, residual=48), "fp16"], ids=str)
def test_a_row_gives_the_same_bits_alone_in_a_batch_and_shared_between_threads(scheme, hd, nh, nkv):
    """With rows enough for the threads, a task is a row, all its KV heads (the pool row is read once); with
    fewer, the threads share each row: its scores a few blocks at a time, its value sums a segment at a time
    (for all heads, or one head a task when segments are few), added up in order after. Either way a segment's
    sums start from zero and the segments are added in order, so a row alone, a row in a batch and any number
    of threads give the same bits: batched decode equals sequential. Rows of 1 to 3 segments, with and without
    a sliding window, on every instruction-set path."""
    gen = torch.Generator().manual_seed(nh)
    attend, meta, _ = long_rows(scheme, hd, nkv, gen)
    q = torch.randn(len(LONG), 1, nh, hd, generator=gen)
    threads = torch.get_num_threads()
    try:
        for window in (None, 700):
            def runs():
                torch.set_num_threads(1)  # 4 rows >= 2 x 1 thread: a row a task
                out = {"batch, a row a task": attend(q, range(4), window)}
                for n in (1, 2, 4):  # one row < 2 x n threads: shared, all heads or one head a values task
                    torch.set_num_threads(n)
                    out[f"rows alone, {n} threads"] = torch.cat([attend(q, [r], window) for r in range(4)])
                torch.set_num_threads(4)  # 4 rows < 2 x 4: shared
                out["batch, 4 threads"] = attend(q, range(4), window)
                out["two long rows, 2 threads"] = torch.cat([attend(q, [0, 1], window), attend(q, [2, 3], window)])
                return out
            for outs in attend_each_isa(runs):
                want = outs.pop("batch, a row a task")
                for name, got in outs.items():
                    assert torch.equal(got, want), (name, window, (got - want).abs().max())
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("scheme", [KVScheme(8, 8), KVScheme(4, 4), KVScheme(2, 2, v_group=64),
                                    KVScheme(8, 8, scheme="fp8"), KVScheme(16, 4), KVScheme(4, 16), "fp16"], ids=str)
def test_rows_of_several_segments_match_dequantize_then_attend(scheme):
    """Value sums of several segments, added up, and scores shared between threads: rows up to 1,101 tokens
    alone (shared between threads) and together (a row a task) equal the dequantize-everything reference."""
    hd, nh, nkv = 64, 9, 3
    gen = torch.Generator().manual_seed(7)
    attend, meta, layer = long_rows(scheme, hd, nkv, gen)
    q = torch.randn(len(LONG), 1, nh, hd, generator=gen)
    keys, values = layer.read(meta.block_tables) if scheme == "fp16" else layer.read_meta(meta)
    for window in (None, 700):
        want = reference(q, keys, values, meta, window, 0.125)
        torch.testing.assert_close(attend(q, range(4), window), want, rtol=1e-4, atol=1e-5)
        alone = torch.cat([attend(q, [r], window) for r in range(4)])
        torch.testing.assert_close(alone, want, rtol=1e-4, atol=1e-5)


UNEVEN = [[5, 6, 7], list(range(10, 19)), list(range(20, 37)), list(range(40, 70))]


QUANTIZED = ("kc", "ks", "km", "vc", "vs", "vm")  # a quantized pool's stored blocks (not its fp32 residual ring)


def decode_logits(model, scheme, kernel: bool, monkeypatch, stored: list):
    """Every decode step's logits for UNEVEN, teacher-forced on fixed continuations; into ``stored``, every step's
    quantized blocks (layer by layer, as bytes)."""
    with monkeypatch.context() as m:
        if not kernel:  # the dense read; with the kernel, the pool's own choice
            m.setattr(QuantBlockKV, "decode_kernel", property(lambda self: False))
        eng = Engine(model, block_size=BS, kv_capacity_tokens=1024, kv_scheme=scheme)
        assert all(layer.decode_kernel == kernel for layer in eng.pool.layers)
        pools = [layer.s[n] for layer in eng.pool.layers for n in QUANTIZED if layer.s.get(n) is not None]
        for t in pools:  # blocks not yet written hold whatever the allocation left
            t.zero_()
        seen = []
        orig = eng.runner.decode

        def decode(seqs):
            seen.append(orig(seqs))
            stored.append([t.flatten().view(torch.uint8).clone() for t in pools])
            return seen[-1]
        eng.runner.decode = decode
        eng.generate(UNEVEN, SamplingParams(max_new_tokens=24, ignore_eos=True))
    return seen


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral-window", "gpt2"])
@pytest.mark.parametrize("scheme", [KVScheme(4, 4, v_group=16), KVScheme(8, 8, scheme="fp8"),
                                    KVScheme(16, 8, v_group=16)], ids=lambda s: s.describe())
def test_the_model_decodes_the_same_with_the_kernel_and_the_dequantized_read(tiny_models, family, scheme, monkeypatch):
    """Through the engine, at the model's output: decode logits with the kernel equal those of the
    dequantize-then-SDPA path, as long as both chose the same tokens (random tiny models tie often) and stored
    the same codes. The two paths compute K and V in different summation orders (the fused native step,
    torch), so a value within an ulp of a rounding boundary can take the neighbouring code when its block is
    quantized (an FP8 step is 6% of the value; seen on a Zen 4 EPYC at step 17): from then on the caches differ,
    as after a different token. A step whose logits differ is therefore excused only when the bytes stored by
    that very step differ between the paths; a wrong read fails at once, with the same stored bytes."""
    model = load_model(tiny_models[family][0])
    stored_slow, stored_fast = [], []
    slow = decode_logits(model, scheme, False, monkeypatch, stored_slow)
    fast = decode_logits(model, scheme, True, monkeypatch, stored_fast)
    assert len(fast) == len(slow) == 23
    compared, before = 0, None
    for a, b, sa, sb in zip(fast, slow, stored_fast, stored_slow):
        differ = sum(int((x != y).sum()) for x, y in zip(sa, sb))  # bytes of the pools that differ
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-4):
            assert before is not None and differ != before, (compared, differ, before)
            break  # this step stored a different code: later steps read different caches
        compared += 1
        before = differ
        if not torch.equal(a.argmax(-1), b.argmax(-1)):
            break  # the paths chose different tokens: later steps see different contexts
    assert compared >= 8, compared


@pytest.mark.parametrize("scheme", [KVScheme(scheme="fp16"), KVScheme(scheme="bf16")], ids=lambda s: s.describe())
def test_an_fp16_cache_decodes_like_the_fp32_cache_and_batched_equals_sequential(tiny_models, scheme, path):
    """On the kernel path and on torch's (kernels off: the pool is read whole and widened)."""
    model = load_model(tiny_models["llama"][0])
    eng = Engine(model, block_size=BS, kv_scheme=scheme)
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    batched = [s.output_ids for s in eng.generate(UNEVEN, sp)]
    assert eng.pool.k.dtype == scheme.storage_dtype
    assert batched == [eng.generate([p], sp)[0].output_ids for p in UNEVEN]
    fp32 = Engine(model, block_size=BS)
    want = [s.output_ids for s in fp32.generate(UNEVEN, sp)]
    agree = sum(a == b for x, y in zip(batched, want) for a, b in zip(x, y)) / sum(map(len, want))
    assert agree >= 0.9, agree


def test_the_fp16_scheme_says_what_it_stores():
    s = KVScheme(scheme="fp16")
    assert (s.k_bits, s.v_bits, s.quantized, s.describe()) == (16, 16, False, "fp16")
    assert s.bytes_per_token(30, 3, 64) == 23040  # SmolLM2: what llama.cpp and vLLM store by default
    assert KVScheme().k_bits == 8  # the quantized schemes keep their default
    with pytest.raises(ValueError, match="unquantized"):
        KVScheme(4, 4, scheme="bf16")


@pytest.mark.parametrize("scheme", [KVScheme(4, 2), KVScheme(8, 8, scheme="fp8"), KVScheme(4, 4, residual=48),
                                    KVScheme(4, 4, scheme="per-tensor"), KVScheme(16, 4)], ids=lambda s: s.describe())
def test_token_by_token_writes_store_what_one_prefill_stores(scheme):
    """The decode write (every token into its ring, a leaving block quantized from the ring, all rows at once)
    leaves the pool bit-identical to the prefill write (blocks quantized from the incoming tokens)."""
    nkv, hd = 2, 64
    gen = torch.Generator().manual_seed(3)
    lens = [37, 70, 5]
    ks, vs = zip(*(kv_like(n, nkv, hd, gen) for n in lens))
    pools = []
    for whole in (True, False):
        pool = QuantKVPool(1, 32, BS, nkv, hd, torch.float32, scheme, max_seqs=3)
        layer = pool.layers[0]
        b = Batch(lens, nblk=6)
        if whole:
            layer.write_meta(b.meta(lens), torch.cat(ks), torch.cat(vs))
        else:
            for i in range(max(lens)):
                rows = [r for r, n in enumerate(lens) if i < n]
                b.lens = [min(i + 1, n) for n in lens]
                layer.write_meta(b.meta([int(i < n) for n in lens]), torch.cat([ks[r][i:i + 1] for r in rows]),
                                 torch.cat([vs[r][i:i + 1] for r in rows]))
        pools.append(pool)
    for name, t in pools[0].store.items():
        if name not in ("rk", "rv"):
            assert torch.equal(t, pools[1].store[name]), name
    layer = pools[0].layers[0]
    for r, n in enumerate(lens):  # the rings agree on every live token (a freed slot keeps stale rows, never read)
        for j in range(layer.quantized_blocks(n), -(-n // BS)):
            live = min(BS, n - j * BS)
            for name in ("rk", "rv"):
                a, b = (p.store[name][0, r, j % layer.windows, :live] for p in pools)
                assert torch.equal(a, b), (name, r, j)
