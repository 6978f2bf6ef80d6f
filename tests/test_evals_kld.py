"""KL divergence from top-K records against the full-vocabulary computation, and llama.cpp's statistics."""

import math

import numpy as np
import pytest
import torch

from qbench.evals.chunks import base_record, kld_topk
from qbench.evals.stats import kld_summary, mcnemar_exact, paired_bootstrap, wilson


def dists(n=400, v=128, seed=0, noise=0.3):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, v, generator=g) * 3
    cand = base + noise * torch.randn(n, v, generator=g)
    return base.log_softmax(-1), cand.log_softmax(-1)


@pytest.mark.parametrize("k", [1, 8, 32])
def test_top_k_kld_is_a_lower_bound_within_the_stated_gap(k):
    """Merging the tail never raises KL, and the gap is exactly p_tail * KL of the conditional tails."""
    lp, lq = dists()
    targets = torch.zeros(lp.shape[0], dtype=torch.int64)
    approx = kld_topk(base_record(lp, targets, k), lq)
    full = (lp.exp() * (lp - lq)).sum(-1)  # the slow, obvious full-vocabulary KL
    assert (approx <= full + 1e-5).all()
    top = lp.topk(k, dim=-1).indices
    tail = torch.ones_like(lp, dtype=torch.bool).scatter_(1, top, False)
    p_tail = (lp.exp() * tail).sum(-1)
    pc = torch.where(tail, lp.exp(), 0) / p_tail[:, None]
    qc = torch.where(tail, lq.exp(), 0) / (lq.exp() * tail).sum(-1, keepdim=True)
    cond = torch.where(tail, pc * (pc.clamp(min=1e-30).log() - qc.clamp(min=1e-30).log()), 0).sum(-1)
    assert torch.allclose(full - approx, p_tail * cond, atol=1e-4)
    if k == 32:  # with 32 of 128 tokens kept on these peaked distributions, the bias is small
        assert (full.mean() - approx.mean()) / full.mean() < 0.05


def test_top_k_kld_on_a_tiny_model_matches_the_full_vocabulary(tiny_models, tmp_path):
    """The tiny model against its own INT4 g32 quantization: top-32 of a 128-token vocabulary."""
    from qbench.layers.attention import AttnMetadata
    from qbench.models.registry import load_model
    from qbench.quant.artifact import load_artifact
    from qbench.quant.quantize import run_quantize
    folder, _ = tiny_models["llama"]
    ids = torch.randint(2, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    meta = AttnMetadata(positions=torch.arange(64)[None])
    lp = load_model(folder)(ids, meta)[0].log_softmax(-1)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: w4g32\nweights: {bits: 4, group_size: 32}\n")
    run_quantize(str(folder), str(recipe), tmp_path / "q", log=lambda s: None)
    lq = load_artifact(tmp_path / "q")[0](ids, meta)[0].log_softmax(-1)
    full = (lp.exp() * (lp - lq)).sum(-1)
    assert full.mean() > 1e-4
    gaps = []
    for k in (8, 32, 96, 128):
        approx = kld_topk(base_record(lp, ids[0], k), lq)
        assert (approx <= full + 1e-6).all()
        gaps.append((full - approx).mean().item())
    # a random tiny model spreads its mass, so the tail matters; the gap shrinks to 0 as K reaches the vocabulary
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < 1e-5 and gaps[0] > 10 * max(gaps[-1], 1e-7)


def test_kld_summary_matches_hand_computation():
    rng = np.random.default_rng(0)
    n = 1000
    kld = rng.exponential(0.05, n)
    pb, pq = rng.uniform(0, 1, n), rng.uniform(0, 1, n)
    nb = rng.exponential(2.0, n)
    nq = nb + rng.normal(0.05, 0.1, n)
    same = rng.uniform(0, 1, n) < 0.9
    s = kld_summary(kld, pb, pq, same, nb, nq)
    assert s["kld"]["mean"] == pytest.approx(kld.mean())
    assert s["kld"]["se"] == pytest.approx(kld.std(ddof=1) / math.sqrt(n))
    assert s["kld"]["p99.9"] == pytest.approx(np.percentile(kld, 99.9)) and s["kld"]["max"] == kld.max()
    assert set(s["kld"]) >= {"p99", "p95", "p90", "median", "p10", "p5", "p1", "p0.1", "min"}
    dp = pq - pb
    assert s["delta_p"]["rms"] == pytest.approx(math.sqrt((dp ** 2).mean()))
    assert s["same_top_p"]["mean"] == pytest.approx(same.mean())
    assert s["ppl_q"]["value"] == pytest.approx(math.exp(nq.mean()))
    assert s["ppl_ratio"]["value"] == pytest.approx(math.exp(nq.mean()) / math.exp(nb.mean()))
    # covariance-aware: the paired SE is far below the SE that ignores the correlation
    naive = math.sqrt(nq.var(ddof=1) / n + nb.var(ddof=1) / n)
    assert s["ln_ppl_ratio"]["se"] == pytest.approx((nq - nb).std(ddof=1) / math.sqrt(n))
    assert s["ln_ppl_ratio"]["se"] < naive / 5 and s["ln_ppl_correlation"] > 0.99


def test_paired_tests():
    base = np.array([1] * 30 + [0] * 70, dtype=bool)
    cand = base.copy()
    cand[:10] = False  # 10 lost, none gained
    m = mcnemar_exact(base, cand)
    assert (m["base_only"], m["candidate_only"]) == (10, 0)
    assert m["p_value"] == pytest.approx(2 * 0.5 ** 10) and m["significant"]
    assert mcnemar_exact(base, base)["p_value"] == 1.0
    ci = paired_bootstrap(base.astype(float), cand.astype(float), seed=0)
    assert ci["diff"] == pytest.approx(-0.1) and ci["high"] < 0 and ci["significant"]
    lo, hi = wilson(30, 100)
    assert lo < 0.3 < hi and hi - lo == pytest.approx(0.18, abs=0.01)
