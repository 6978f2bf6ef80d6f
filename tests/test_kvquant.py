"""KV-cache quantization math: round trips, packing, exact sizes, and the K-outlier asymmetry measured."""

import pytest
import torch

from qbench.kernels import build as kernels
from qbench.kernels import ops
from qbench.layers.kvquant import (Codec, dequantize_fp8_per_token, dequantize_k_per_channel, dequantize_per_tensor,
                                   dequantize_v_per_token, pack_bits, quantize_fp8_per_token, quantize_k_per_channel,
                                   quantize_k_per_token, quantize_per_tensor, quantize_v_per_token, unpack_bits)
from qbench.layers.kvscheme import KVScheme

G = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_packing_roundtrip_lowest_index_in_lowest_bits(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 64), generator=G).to(torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8)
    assert torch.equal(unpack_bits(packed, bits), codes)
    if bits == 2:
        assert pack_bits(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8), 2).tolist() == [[0b00111001]]


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_k_per_channel_round_trip_is_within_half_a_step(bits):
    k = torch.randn(16, 3, 64, generator=G) * torch.linspace(0.1, 5, 64)
    q = quantize_k_per_channel(k, bits)
    assert q.scale.shape == (3, 64) and q.scale.dtype == torch.float16  # one per (head, channel) per group
    err = (dequantize_k_per_channel(q) - k).abs()
    bound = q.scale.float() / 2 + k.abs().amax(0) * 1e-3  # half a step, plus fp16 rounding of the minimum
    assert (err <= bound).all()


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_v_per_token_round_trip_is_within_half_a_step(bits):
    v = torch.randn(37, 3, 64, generator=G)
    q = quantize_v_per_token(v, bits, 32)
    assert q.scale.shape == (37, 3, 2)
    err = (dequantize_v_per_token(q) - v).abs().view(37, 3, 2, 32)
    assert (err <= q.scale.float()[..., None] / 2 + v.abs().max() * 1e-3).all()


def test_fp8_per_token():
    x = torch.randn(20, 3, 64, generator=G) * 7
    q = quantize_fp8_per_token(x)
    assert q.codes.dtype == torch.uint8 and q.scale.shape == (20,)
    rel = (dequantize_fp8_per_token(q) - x).abs() / x.abs().clamp(min=1e-3)
    big = x.abs() > x.abs().amax(dim=(1, 2), keepdim=True) / 64  # away from e4m3's subnormals
    assert rel[big].max() <= 2 ** -4 + 1e-3  # three mantissa bits


def test_per_channel_k_beats_the_naive_baselines_on_real_smollm2_keys(smollm2):
    """The seeds say keys have per-channel outliers; measure it on SmolLM2's own cache."""
    from qbench.engine.api import load_tokenizer
    from qbench.engine.engine import Engine
    from qbench.engine.sampling import SamplingParams
    from qbench.engine.sequence import Sequence
    from qbench.models.registry import load_model
    from qbench.quant.calibration import PROJECT_ROOT
    text = (PROJECT_ROOT / "evals/data/wikitext-2-raw/wiki.valid.raw").read_text(encoding="utf-8")[:3000]
    ids = load_tokenizer(smollm2)(text)["input_ids"][:256]
    eng = Engine(load_model(smollm2), block_size=16, kv_capacity_tokens=512)
    seq = Sequence(ids, SamplingParams())
    eng.blocks.reserve(seq, len(seq))
    eng.runner.prefill([seq])  # the prompt's keys, as the engine cached them
    errs = {"per-channel": [], "per-token": [], "per-tensor": []}
    for layer in range(0, 30, 3):
        k = eng.pool.k[layer][torch.tensor(seq.block_table)].reshape(-1, 3, 64)[:256]
        for g in range(0, 256, 16):  # groups of 16 tokens, as the block cache stores them
            kg = k[g: g + 16]
            n = kg.norm()
            errs["per-channel"].append(((dequantize_k_per_channel(quantize_k_per_channel(kg, 4)) - kg).norm() / n))
            errs["per-token"].append(((dequantize_v_per_token(quantize_k_per_token(kg, 4, 64)) - kg).norm() / n))
            errs["per-tensor"].append(((dequantize_per_tensor(quantize_per_tensor(kg, 4)) - kg).norm() / n))
    mean = {name: torch.stack(v).mean().item() for name, v in errs.items()}
    print("K4 relative error on SmolLM2 keys", mean)
    assert mean["per-channel"] < mean["per-token"] < mean["per-tensor"], mean


def test_bytes_per_token_are_exact():
    # SmolLM2: 30 layers, 3 KV heads, head_dim 64
    assert KVScheme(16, 16).bytes_per_token(30, 3, 64) == 2 * 30 * 3 * 64 * 4  # fp32 cache
    assert KVScheme(16, 16).bytes_per_token(30, 3, 64, fp_bytes=2) == 2 * 30 * 3 * 64 * 2  # fp16 cache
    # KV8: 192 B of codes + per-channel K statistics (768 B per 16 tokens) + per-token V statistics (24 B)
    assert KVScheme(8, 8).bytes_per_token(30, 3, 64) == 30 * (192 + 48 + 192 + 24)
    # K4: 96 B of codes + 4 B (fp16 scale + min) per channel per 16 tokens; V2: 48 B + 4 B per 32 channels
    assert KVScheme(k_bits=4, v_bits=2, group=16, v_group=32).bytes_per_token(30, 3, 64) == 30 * (144 + 72)
    assert KVScheme(8, 8, scheme="fp8").bytes_per_token(30, 3, 64) == 30 * 2 * (192 + 2)
    assert KVScheme(4, 4, scheme="per-tensor").bytes_per_token(30, 3, 64) == 30 * 2 * (96 + 4 / 16)
    # K16: full precision K, V4 per token
    assert KVScheme(16, 4).bytes_per_token(30, 3, 64) == 30 * (768 + 96 + 24)
    assert KVScheme(8, 8, residual=64).residual_bytes(30, 3, 64) == 30 * 2 * 64 * 192 * 4


@pytest.mark.parametrize("kwargs, field", [
    ({"k_bits": 3}, "kv.k_bits"), ({"v_bits": 1}, "kv.v_bits"), ({"scheme": "kivy"}, "kv.scheme"),
    ({"residual": 24}, "kv.residual"), ({"group": 0}, "kv.group"), ({"scheme": "fp8", "k_bits": 4}, "kv.scheme"),
])
def test_bad_schemes_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        KVScheme(**kwargs)


@pytest.mark.parametrize("scheme", [KVScheme(8, 8), KVScheme(4, 2), KVScheme(8, 8, scheme="fp8"),
                                    KVScheme(4, 4, scheme="per-tensor"), KVScheme(4, 4, scheme="per-token-k"),
                                    KVScheme(16, 4)])
def test_codecs_dequantize_a_whole_block_table_at_once(scheme):
    """The batched dequantize (used on every attention read) equals block-by-block dequantize."""
    blocks = [torch.randn(16, 3, 64, generator=G) * torch.linspace(0.1, 4, 64) for _ in range(5)]
    for codec in scheme.codecs():
        qs = [codec.quantize(b) for b in blocks]
        one = torch.stack([codec.dequantize(q.codes, q.scale, q.minimum) for q in qs])
        st = [None if getattr(qs[0], a) is None else torch.stack([getattr(q, a) for q in qs])[None]
              for a in ("scale", "minimum")]
        many = codec.dequantize(torch.stack([q.codes for q in qs])[None], *st)[0]  # (1, 5, ...) leading dims
        assert torch.equal(one, many)
        err = (one - torch.stack(blocks)).norm() / torch.stack(blocks).norm()
        assert err < {16: 1e-7, 8: 0.05, 4: 0.25, 2: 0.6}[codec.bits], (codec, err)


def _blocks(kind: str, g: torch.Generator) -> torch.Tensor:
    """Five blocks (16, 3, 64) of keys or values; the edge cases of min/max quantization among them."""
    x = torch.randn(5, 16, 3, 64, generator=g)
    if kind == "outliers":  # a channel and a token far out
        x[:, :, :, 3] *= 100
        x[:, 2, 1, :] *= 1e3
    elif kind == "constant":  # zero ranges: the scale clamps to 1e-8, which fp16 rounds to 0 (codes 0 / 0 -> 0)
        x[:, :, 0, 5] = 0.7
        x[:, :, 1, :32] = -2.5
    elif kind == "narrow":  # ranges below fp16's resolution at the minimum: x - half(min) < 0 for some x
        x = 1.0 + 1e-7 * x
    elif kind == "wide":  # statistics past fp16's largest finite value: infinite scale and minimum
        x = 3e4 * x
    return x


@pytest.mark.skipif(not kernels.available(), reason="native kernels not built here")
@pytest.mark.parametrize("kind", ["normal", "outliers", "constant", "narrow", "wide"])
@pytest.mark.parametrize("codec", [Codec("channel", b) for b in (8, 4, 2)]
                         + [Codec("token", b, gs) for b in (8, 4, 2) for gs in (16, 32, 64)], ids=str)
def test_the_native_block_store_gives_the_codecs_bits(codec, kind):
    """qb_kv_store (the decode step's and the pool's block writes) against Codec.quantize: every code byte and
    every fp16 statistic equal, into blocks scattered through the pool, read directly or through row indices."""
    x = _blocks(kind, torch.Generator().manual_seed(len(kind)))
    mode = ops.KV_CHANNEL if codec.mode == "channel" else ops.KV_TOKEN
    want = codec.quantize(x)
    for rows in (None, torch.tensor([4, 0, 3, 1, 2])):
        src = x if rows is None else x[torch.argsort(rows)]  # src[rows[i]] == x[i]
        codes = torch.full((9, *codec.code_shape(16, 3, 64)), 7, dtype=torch.uint8)
        scale = torch.zeros(9, *codec.stat_shape(16, 3, 64), dtype=torch.float16)
        minimum = torch.zeros_like(scale)
        blocks = torch.tensor([8, 2, 5, 0, 6])
        ops.kv_store(src, rows, blocks, mode, codec.bits, codec.group, codes, scale, minimum)
        assert torch.equal(codes[blocks], want.codes)
        assert torch.equal(scale[blocks].view(torch.int16), want.scale.view(torch.int16))
        assert torch.equal(minimum[blocks].view(torch.int16), want.minimum.view(torch.int16))
        untouched = torch.tensor([1, 3, 4, 7])
        assert (codes[untouched] == 7).all() and (scale[untouched] == 0).all()


@pytest.mark.skipif(not kernels.available(), reason="native kernels not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_native_block_store_copies_unquantized_rows_as_torch_rounds_them(dtype):
    x = _blocks("wide", torch.Generator().manual_seed(1)) * 10  # past fp16's range too: inf, as torch gives
    x[0, 0, 0, :4] = torch.tensor([float("nan"), 1e-30, -0.0, 2.0 ** -25])
    pool = torch.zeros(7, 16, 3, 64, dtype=dtype)
    blocks = torch.tensor([3, 6, 0, 2, 5])
    ops.kv_store(x, None, blocks, ops.fp_mode(dtype), 16, 0, pool, None, None)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    got, want = pool[blocks], x.to(dtype)
    nan = want.isnan()  # a NaN stays a NaN (torch's own bf16 NaN bits differ between its scalar and vector code)
    assert torch.equal(got.isnan(), nan) and nan.sum() == 1
    assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])
