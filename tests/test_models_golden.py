"""Golden reference: qbench's forward passes against transformers on every supported family."""

import pytest
import torch

from conftest import FAMILIES
from qbench.engine.block_manager import BlockManager
from qbench.engine.kv_cache import KVPool
from qbench.engine.runner import ModelRunner
from qbench.engine.sampling import SamplingParams
from qbench.engine.sequence import Sequence
from qbench.layers.attention import AttnMetadata
from qbench.models.registry import load_model

TOL = 2e-4  # max |logit difference|, float32, on logits of magnitude ~1-10




def cached_logits(model, tokens: list[int], prompt_len: int, block_size: int = 4) -> torch.Tensor:
    """Prefill tokens[:prompt_len], then decode the rest one by one -> logits at positions prompt_len-1.."""
    cfg = model.config
    pool = KVPool(cfg.num_layers, 64, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    bm, runner = BlockManager(64, block_size), ModelRunner(model, pool)
    seq = Sequence(tokens[:prompt_len], SamplingParams())
    bm.reserve(seq, len(seq))
    out = [runner.prefill([seq])]
    for t in tokens[prompt_len:]:
        seq.output_ids.append(t)
        bm.reserve(seq, len(seq))
        out.append(runner.decode([seq]))
    return torch.cat(out)  # (n, V)


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_logits_match_transformers(tiny_models, family, path):
    folder, hf = tiny_models[family]
    ours = load_model(folder)
    ids = torch.randint(2, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    got = ours(ids, AttnMetadata(positions=torch.arange(17).expand(2, 17)))
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero tensors
    assert (got - ref).abs().max() < TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_prefill_then_decode_matches_transformers(tiny_models, family, path):
    folder, hf = tiny_models[family]
    ours = load_model(folder)
    tokens = torch.randint(2, 128, (23,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0, 10:]  # positions 10..22
    got = cached_logits(ours, tokens, prompt_len=11)  # crosses several 4-token blocks
    assert (got - ref).abs().max() < TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_gqa_cache_holds_kv_heads_only(tiny_models):
    folder, _ = tiny_models["llama"]
    m = load_model(folder)
    pool = KVPool(m.config.num_layers, 8, 16, m.config.num_kv_heads, m.config.head_dim, torch.float32)
    assert m.config.num_kv_heads < m.config.num_heads
    assert pool.k.shape == (2, 8, 16, m.config.num_kv_heads, 16)


def test_weight_bytes_count_tied_tensors_once(tiny_models):
    folder, hf = tiny_models["llama-tied-bias"]
    m = load_model(folder)
    n_params = sum(p.numel() for p in hf.parameters())  # transformers counts the tied tensor once too
    assert m.weight_bytes() == pytest.approx(4 * n_params, rel=0.01)


def test_loading_fixes_the_heap_threshold_first_and_hands_free_memory_back_after(tiny_models, monkeypatch):
    import platform

    from qbench import heap
    if platform.libc_ver()[0] == "glibc":  # where the C library has both calls, both take effect
        assert heap.fix_mmap_threshold() and heap.release_free_memory()
    calls = []
    monkeypatch.setattr(heap, "fix_mmap_threshold", lambda: calls.append("fix"))
    monkeypatch.setattr(heap, "release_free_memory", lambda: calls.append("release"))
    real = torch.empty

    def tracked(*a, **k):  # tensors are read between the two calls
        if calls and calls[-1] == "fix":
            calls.append("read")
        return real(*a, **k)
    monkeypatch.setattr(torch, "empty", tracked)
    load_model(tiny_models["llama"][0])
    assert calls == ["fix", "read", "release"]
