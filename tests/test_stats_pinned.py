"""Every statistic qbench reports, pinned to values computed elsewhere: published tables (Newcombe 1998 for
Wilson, Fagerland et al. 2013 for McNemar's exact and mid-p tests), scipy's own implementations, and
closed-form normal theory where the bootstrap must agree with it. Edges included: 0 and n successes, no
discordant pairs, one item. (The MDE is pinned in test_mde.py: Connor's formula and a simulation.)"""

import math

import numpy as np
import pytest
from scipy import stats as sps

from qbench.evals.stats import kld_summary, mcnemar_exact, mcnemar_mid_p, paired_bootstrap, wilson


# ---- Wilson ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k,n,low,high", [  # Newcombe (1998), Stat Med 17:857, Table I, method 3
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)])
def test_wilson_equals_newcombes_table(k, n, low, high):
    lo, hi = wilson(k, n)
    assert (round(lo, 4), round(hi, 4)) == (low, high)


@pytest.mark.parametrize("n", [1, 2, 10, 37, 300, 1319])
def test_wilson_equals_scipy_at_every_count_including_the_edges(n):
    for k in sorted({0, 1, n // 3, n // 2, n - 1, n}):
        if not 0 <= k <= n:
            continue
        ci = sps.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        lo, hi = wilson(k, n)
        assert lo == pytest.approx(ci.low, abs=1e-7) and hi == pytest.approx(ci.high, abs=1e-7), (k, n)
    assert wilson(0, n)[0] == 0.0 and wilson(n, n)[1] == 1.0
    assert all(math.isnan(v) for v in wilson(0, 0))


def test_the_wilson_interval_is_not_centred_on_the_estimate():
    # the property a Wald-like interval lacks: pulled towards 1/2, most at small n and extreme p
    lo, hi = wilson(2, 20)
    assert (lo + hi) / 2 == pytest.approx((2 + 1.959964 ** 2 / 2) / (20 + 1.959964 ** 2))
    assert (lo + hi) / 2 > 0.1 + 0.03


# ---- McNemar: exact and mid-p ---------------------------------------------------------------------------

def _pairs(b: int, c: int, same: int = 20):
    """Paired correctness with b pairs right only at baseline and c right only in the candidate."""
    base = [True] * b + [False] * c + [True] * same + [False] * same
    cand = [False] * b + [True] * c + [True] * same + [False] * same
    return base, cand


def test_mcnemar_equals_fagerlands_worked_example():
    # Fagerland, Lydersen and Laake (2013), BMC Med Res Methodol 13:91: 1 and 7 discordant pairs give an
    # exact conditional p of 0.070 and a mid-p of 0.039
    r = mcnemar_exact(*_pairs(1, 7))
    assert round(r["p_value"], 3) == 0.070 and round(r["p_mid"], 3) == 0.039
    assert (r["base_only"], r["candidate_only"]) == (1, 7) and not r["significant"]


@pytest.mark.parametrize("b,c", [(0, 0), (0, 1), (0, 6), (3, 3), (10, 0), (12, 30), (80, 95), (5, 150)])
def test_mcnemar_equals_scipys_binomial_test_and_the_mid_p_its_definition(b, c):
    r = mcnemar_exact(*_pairs(b, c))
    d = b + c
    exact = 1.0 if d == 0 else sps.binomtest(b, d, 0.5, alternative="two-sided").pvalue
    assert r["p_value"] == pytest.approx(exact, rel=1e-12)
    if d:  # mid-p: half the probability of the observed table taken off each tail
        m = min(b, c)
        mid = sum(math.comb(d, i) for i in range(m)) * 2 / 2 ** d + math.comb(d, m) / 2 ** d
        assert r["p_mid"] == pytest.approx(min(1.0, mid), rel=1e-9)
        assert r["p_mid"] <= r["p_value"]
    else:
        assert r["p_mid"] == 1.0
    assert mcnemar_mid_p(b, c) == mcnemar_mid_p(c, b)  # two-sided: the labels do not matter


# ---- the paired bootstrap -------------------------------------------------------------------------------

def test_the_paired_bootstrap_agrees_with_normal_theory_on_paired_data():
    # strongly correlated pairs: the paired SE is a small fraction of the unpaired one, so resampling the
    # two columns apart would give an interval several times too wide
    rng = np.random.default_rng(5)
    n = 3000
    base = rng.normal(2.0, 1.0, n)
    cand = base + rng.normal(0.03, 0.1, n)
    r = paired_bootstrap(base, cand, seed=0, resamples=4000)
    d = cand - base
    se = sps.sem(d)
    z = sps.norm.ppf(0.975)
    assert r["diff"] == pytest.approx(d.mean(), rel=1e-12)
    assert r["low"] == pytest.approx(d.mean() - z * se, abs=0.08 * z * se)
    assert r["high"] == pytest.approx(d.mean() + z * se, abs=0.08 * z * se)
    assert r["significant"]


def test_the_paired_bootstrap_on_binary_items_matches_the_paired_proportion_se():
    base, cand = _pairs(40, 70, same=200)
    base, cand = np.array(base, float), np.array(cand, float)
    n = base.size
    r = paired_bootstrap(base, cand, seed=1, resamples=4000)
    p10, p01 = 40 / n, 70 / n
    se = math.sqrt((p10 + p01 - (p01 - p10) ** 2) / n)  # the paired difference of proportions
    width = r["high"] - r["low"]
    assert width == pytest.approx(2 * 1.959964 * se, rel=0.08)


def test_the_paired_bootstrap_edges():
    same = np.array([1.0, 0.0, 1.0, 1.0])
    assert paired_bootstrap(same, same, seed=0) == {"diff": 0.0, "low": 0.0, "high": 0.0, "significant": False}
    one = paired_bootstrap(np.array([1.0]), np.array([0.0]), seed=0)
    assert one["diff"] == -1.0 and not one["significant"]


# ---- KLD and PPL statistics -----------------------------------------------------------------------------

def test_the_ln_ppl_ratio_se_is_scipys_sem_of_the_paired_differences():
    rng = np.random.default_rng(2)
    n = 5000
    nb = rng.gamma(2.0, 1.2, n)
    nq = nb * 1.02 + rng.normal(0, 0.05, n)
    kld = np.abs(rng.normal(0, 0.01, n))
    pb, pq = np.exp(-nb), np.exp(-nq)
    s = kld_summary(kld, pb, pq, rng.random(n) < 0.9, nb, nq)
    assert s["ln_ppl_ratio"]["value"] == pytest.approx(np.mean(nq - nb), rel=1e-12)
    assert s["ln_ppl_ratio"]["se"] == pytest.approx(sps.sem(nq - nb), rel=1e-10)
    assert s["ppl_ratio"]["se"] == pytest.approx(math.exp(np.mean(nq - nb)) * sps.sem(nq - nb), rel=1e-10)
    assert s["kld"]["mean"] == pytest.approx(kld.mean()) and s["kld"]["se"] == pytest.approx(sps.sem(kld))
    assert s["ppl_q"]["se"] == pytest.approx(math.exp(nq.mean()) * sps.sem(nq), rel=1e-10)
    dp = pq - pb
    assert s["delta_p"]["rms"] == pytest.approx(math.sqrt(np.mean(dp ** 2)))
    assert s["delta_p"]["p99"] == pytest.approx(np.quantile(dp, 0.99))
    # the SE that ignores the pairing is several times larger here: the paired one must not be it
    assert s["ln_ppl_ratio"]["se"] < 0.2 * math.sqrt(sps.sem(nq) ** 2 + sps.sem(nb) ** 2)
