"""Statistics for evaluations: llama.cpp's KL-divergence summary, paired tests and intervals.

Everything here is a pure function of per-token or per-item arrays, so a candidate's numbers
can be recomputed from the records a run keeps.
"""

from __future__ import annotations

import math

import numpy as np

PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)  # llama.cpp's --kl-divergence rows


def mean_se(x) -> tuple[float, float]:
    x = np.asarray(x, dtype=np.float64)
    if x.size < 2:
        return float(x.mean()) if x.size else float("nan"), float("nan")
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))


def distribution(x) -> dict:
    """max, llama.cpp's percentiles, min."""
    x = np.asarray(x, dtype=np.float64)
    out = {"max": float(x.max())}
    for p in PERCENTILES:
        out["median" if p == 50.0 else f"p{p:g}"] = float(np.percentile(x, p))
    out["min"] = float(x.min())
    return out


def kld_summary(kld, p_base, p_q, same_top, nll_base, nll_q) -> dict:
    """The statistics of llama.cpp's ``perplexity --kl-divergence`` from per-token arrays.

    kld: KL(base || candidate) per token; p_base, p_q: probability of the observed next token;
    same_top: whether the argmaxes agree; nll_*: -log p of the observed token.
    """
    kld, p_base, p_q = (np.asarray(a, dtype=np.float64) for a in (kld, p_base, p_q))
    nll_base, nll_q = np.asarray(nll_base, dtype=np.float64), np.asarray(nll_q, dtype=np.float64)
    same = np.asarray(same_top, dtype=np.float64)
    n = kld.size
    m, se = mean_se(kld)
    dp = p_q - p_base
    dpm, dpse = mean_se(dp)
    sq_m, sq_se = mean_se(dp ** 2)
    rms = math.sqrt(sq_m)
    ln_ratio, ln_se = mean_se(nll_q - nll_base)  # paired: var(a) + var(b) - 2 cov(a, b)
    lq, lq_se = mean_se(nll_q)
    lb, lb_se = mean_se(nll_base)
    f = float(same.mean())
    return {
        "tokens": n,
        "kld": {"mean": m, "se": se, **distribution(kld)},
        "delta_p": {"mean": dpm, "se": dpse, **distribution(dp),
                    "rms": rms, "rms_se": sq_se / (2 * rms) if rms > 0 else 0.0},
        "same_top_p": {"mean": f, "se": math.sqrt(f * (1 - f) / n)},
        "ppl_q": {"value": math.exp(lq), "se": math.exp(lq) * lq_se},
        "ppl_base": {"value": math.exp(lb), "se": math.exp(lb) * lb_se},
        "ppl_ratio": {"value": math.exp(ln_ratio), "se": math.exp(ln_ratio) * ln_se},
        "ln_ppl_ratio": {"value": ln_ratio, "se": ln_se},
        "ln_ppl_correlation": float(np.corrcoef(nll_q, nll_base)[0, 1]) if n > 1 else float("nan"),
    }


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for a proportion k / n (95% by default)."""
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    # at 0 and n successes the bound is exactly 0 or 1; the formula leaves a rounding residue there
    return 0.0 if k == 0 else max(0.0, c - h), 1.0 if k == n else min(1.0, c + h)


def mcnemar_exact(base, cand) -> dict:
    """McNemar's exact test on paired correctness: a two-sided binomial test on the discordant pairs."""
    from scipy.stats import binomtest
    base, cand = np.asarray(base, dtype=bool), np.asarray(cand, dtype=bool)
    b = int((base & ~cand).sum())  # right before, wrong now
    c = int((~base & cand).sum())
    p = 1.0 if b + c == 0 else float(binomtest(b, b + c, 0.5).pvalue)
    return {"base_only": b, "candidate_only": c, "p_value": p, "p_mid": mcnemar_mid_p(b, c),
            "significant": p < 0.05, "mde": mcnemar_mde(base.size, b + c)}


def mcnemar_mid_p(b: int, c: int) -> float:
    """The mid-p McNemar test (Fagerland, Lydersen and Laake 2013): the exact test's p less the probability of
    the observed table, 2 [P(X <= m) - P(X = m) / 2] with X ~ Bin(b + c, 1/2) and m = min(b, c). Less
    conservative than the exact test; the verdict stays with the exact p, this is reported beside it."""
    from scipy.stats import binom
    if b + c == 0:
        return 1.0
    m = min(b, c)
    return float(min(1.0, 2 * (binom.cdf(m, b + c, 0.5) - 0.5 * binom.pmf(m, b + c, 0.5))))


def mcnemar_power(n: int, discordance: float, delta: float, alpha: float = 0.05) -> float:
    """Exact power of McNemar's exact test (two-sided, level ``alpha``) on n pairs.

    Pairs are discordant with probability ``discordance``; a discordant pair favours one side with
    probability (discordance + delta) / (2 discordance), so the two accuracies differ by ``delta``.
    The number of discordant pairs D is binomial (n, discordance); given D = d the test rejects when the
    one-sided count k has 2 P(Bin(d, 1/2) <= min(k, d - k)) < alpha, the rule ``binomtest`` applies.
    """
    from scipy.stats import binom
    if not 0 < discordance <= 1 or not 0 <= delta <= discordance:
        raise ValueError(f"need 0 <= delta ({delta}) <= discordance ({discordance}) <= 1")
    d = np.arange(n + 1)
    crit = binom.ppf(alpha / 2, d, 0.5) - 1  # the largest k with P(Bin(d, 1/2) <= k) < alpha / 2
    q = (discordance + delta) / (2 * discordance)
    reject = binom.cdf(crit, d, q) + binom.sf(d - crit - 1, d, q)
    reject = np.where(crit >= 0, reject, 0.0)
    return float(np.clip((binom.pmf(d, n, discordance) * reject).sum(), 0.0, 1.0))


def mcnemar_mde(n: int, discordant: int, alpha: float = 0.05, power: float = 0.8) -> dict:
    """The smallest accuracy difference McNemar's exact test detects with ``power`` on these n pairs.

    The discordance is the observed share of discordant pairs. When none were observed it is taken as the
    one-sided 95% upper bound for 0 of n (1 - 0.05^(1/n)), and said so. A difference delta needs at least
    delta discordance, so the rate used is max(discordance, delta). ``difference`` is None when no
    difference, however large, reaches the power at this n.
    """
    if n == 0:
        return {"difference": None, "n": 0, "discordance": None, "assumption": "no items"}
    observed = discordant / n
    rate, assumption = observed, "observed discordance"
    if discordant == 0:
        rate = 1 - 0.05 ** (1 / n)
        assumption = "no discordant pairs observed: discordance taken as the 95% upper bound for 0 of n"
    out = {"n": n, "discordance": rate, "assumption": assumption, "power": power, "alpha": alpha}
    pw = lambda x: mcnemar_power(n, max(rate, x), x, alpha)  # noqa: E731
    if pw(1.0) < power:
        return {"difference": None, **out}
    lo, hi = 0.0, 1.0  # the power grows with delta: bisect to 1e-4
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if pw(mid) >= power else (mid, hi)
    return {"difference": hi, **out}


def paired_bootstrap(base, cand, seed: int, resamples: int = 2000, statistic=np.mean) -> dict:
    """95% CI of statistic(cand) - statistic(base) over items resampled in pairs (scipy.stats.bootstrap)."""
    from scipy.stats import bootstrap
    base, cand = np.asarray(base, dtype=np.float64), np.asarray(cand, dtype=np.float64)
    diff = float(statistic(cand) - statistic(base))
    if base.size < 2 or np.all(cand - base == cand[0] - base[0]):
        return {"diff": diff, "low": diff, "high": diff, "significant": False}
    res = bootstrap((base, cand), lambda b, c, axis=-1: statistic(c, axis=axis) - statistic(b, axis=axis),
                    paired=True, vectorized=True, n_resamples=resamples, method="percentile",
                    random_state=np.random.default_rng(seed))
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return {"diff": diff, "low": lo, "high": hi, "significant": not (lo <= 0.0 <= hi)}
