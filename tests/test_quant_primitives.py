import pytest
import torch

from qbench.quant.primitives import (bytes_per_weight, dequantize, fake_quantize, pack_int4, quantize_int4,
                                     quantize_int8, storage_bytes, unpack_int4)


def W(n=48, k=256, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_int8_symmetric_per_output_channel():
    w = W()
    q = quantize_int8(w)
    assert q.codes.dtype == torch.int8 and q.scale.dtype == torch.float16 and q.scale.shape == (48,)
    assert torch.allclose(q.scale.float(), (w.abs().amax(1) / 127).half().float())
    assert q.codes.abs().max() == 127
    err = (dequantize(q) - w).abs()
    assert (err <= q.scale.float()[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_symmetric_group_scale_is_absmax_over_7_and_codes_in_range(group):
    w = W()
    q = quantize_int4(w, group, symmetric=True)
    assert q.scale.dtype == torch.float16 and q.scale.shape == (48, 256 // group)
    expect = (w.view(48, -1, group).abs().amax(-1) / 7).half()
    assert torch.equal(q.scale, expect)
    signed = q.codes.to(torch.int16) - 8
    assert signed.min() >= -8 and signed.max() <= 7
    err = (dequantize(q) - w).abs().view(48, -1, group)
    assert (err <= q.scale.float()[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_asymmetric_min_max_with_zero_point(group):
    w = W() + 0.7  # shifted: asymmetric pays off
    q = quantize_int4(w, group, symmetric=False)
    assert q.zero is not None and q.zero.dtype == torch.uint8 and q.zero.max() <= 15
    assert q.codes.max() <= 15
    sym = quantize_int4(w, group, symmetric=True)
    assert (dequantize(q) - w).norm() < (dequantize(sym) - w).norm()
    err = (dequantize(q) - w).abs().view(48, -1, group)
    assert (err <= q.scale.float()[..., None] / 2 + 1e-5).all()


def test_unsupported_group_size():
    with pytest.raises(ValueError, match="group size 96 is not supported"):
        quantize_int4(W(), 96)


def test_width_not_multiple_of_group_pads_the_last_group():
    w = W(8, 576)  # SmolLM2's width: 4.5 groups of 128
    q = quantize_int4(w, 128)
    assert q.codes.shape == (8, 640) and q.scale.shape == (8, 5)
    assert torch.equal(q.codes[:, 576:], torch.full((8, 64), 8, dtype=torch.uint8))  # code 8 is zero
    assert torch.equal(q.scale, (torch.nn.functional.pad(w, (0, 64)).view(8, 5, 128).abs().amax(-1) / 7).half())
    d = dequantize(q)
    assert d.shape == (8, 576)
    assert (d - w).abs().max() <= q.scale.float().max() / 2 + 1e-6
    qa = quantize_int4(w + 0.3, 128, symmetric=False)
    full = ((qa.codes.float().view(8, 5, 128) - qa.zero.float()[..., None]) * qa.scale.float()[..., None]).view(8, -1)
    assert torch.equal(full[:, 576:], torch.zeros(8, 64))  # padded columns dequantize to exactly zero


def test_packing_is_two_nibbles_per_byte_even_index_low():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(unpack_int4(packed), codes)
    q = quantize_int4(W(), 64)
    assert torch.equal(unpack_int4(pack_int4(q.codes)), q.codes)


def test_storage_size_is_exact():
    assert bytes_per_weight(4, 128, True) == 0.515625  # the seeds' figure
    assert bytes_per_weight(4, 64, False) == 0.5 + 3 / 64
    q = quantize_int4(W(64, 1024), 128)
    assert storage_bytes(q) == 64 * 1024 * 0.515625
    qa = quantize_int4(W(64, 1024), 128, symmetric=False)
    assert storage_bytes(qa) == 64 * 1024 // 2 + 64 * 8 * 2 + 64 * 8
    assert storage_bytes(quantize_int8(W(64, 1024))) == 64 * 1024 + 64 * 2


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("K", [128, 200, 576])
def test_fake_quantize_equals_dequantize_of_the_stored_codes(group, symmetric, K):
    """fake_quantize keeps INT4 codes in float (AWQ's search calls it 20 times per mapping): its values must be
    those of quantize-then-dequantize, bit for bit, padded last group and all-zero groups included."""
    g = torch.Generator().manual_seed(K + group)
    w = torch.randn(24, K, generator=g, dtype=torch.float64) * torch.rand(24, 1, generator=g, dtype=torch.float64) * 3
    w[3, : min(group, K)] = 0  # a group of zeros
    w[5] = w[5].abs()  # all positive: the asymmetric grid's zero point at 0
    assert torch.equal(fake_quantize(w, 4, group, symmetric), dequantize(quantize_int4(w, group, symmetric)))
    assert torch.equal(fake_quantize(w, 8, None, True), dequantize(quantize_int8(w)))
