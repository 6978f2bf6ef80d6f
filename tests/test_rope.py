import torch
import pytest

from qbench.layers.rope import RopeTable, apply_rope, rope_inv_freq


def test_chunked_then_token_by_token_is_bit_identical_to_whole():
    table = RopeTable(64, 4096, 100000.0)
    x = torch.randn(1, 300, 3, 64)
    pos = torch.arange(300)[None]
    cos, sin = table.lookup(pos, torch.float32)
    whole = apply_rope(x, cos, sin)
    parts = []
    for a, b in [(0, 128), (128, 250)]:  # two prefill chunks
        c, s = table.lookup(pos[:, a:b], torch.float32)
        parts.append(apply_rope(x[:, a:b], c, s))
    for t in range(250, 300):  # then decode, one token at a time
        c, s = table.lookup(pos[:, t:t + 1], torch.float32)
        parts.append(apply_rope(x[:, t:t + 1], c, s))
    assert torch.equal(torch.cat(parts, dim=1), whole)


def test_positions_must_be_integers():
    table = RopeTable(8, 16, 10000.0)
    with pytest.raises(TypeError):
        table.lookup(torch.arange(4, dtype=torch.float32)[None], torch.float32)


def test_table_is_float32_even_for_bf16_models():
    # the seeds: position 100,000 in bf16 rounds to 99,840; the table must not see bf16 positions
    table = RopeTable(64, 100_001, 100000.0)
    assert table.cos.dtype == torch.float32
    inv = rope_inv_freq(64, 100000.0).double()
    exact = (100_000.0 * inv).cos()
    # float32 angles near 1e5 carry ~1e-2 rad of rounding; bf16 positions are off by 160 tokens
    assert (table.cos[100_000].double() - exact).abs().max() < 1e-2
    bf16_pos = torch.tensor(100_000.0).to(torch.bfloat16).double()
    assert bf16_pos.item() == 99_840.0
    assert ((bf16_pos * inv).cos() - exact).abs().max() > 0.5


def test_llama3_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_scaling=scaling, rope_theta=500000.0,
                      max_position_embeddings=131072)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = rope_inv_freq(128, 500000.0, scaling)
    assert torch.allclose(ours, ref.float(), rtol=1e-6)
