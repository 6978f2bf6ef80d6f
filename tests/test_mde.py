"""The minimum detectable difference of McNemar's exact test: pinned to the asymptotic sample-size formula
(Connor 1987) where that holds, to a simulation of the test itself, and to the edges."""

import numpy as np
import pytest
from scipy.stats import binomtest, norm

from qbench.evals.stats import mcnemar_exact, mcnemar_mde, mcnemar_power


def _connor_n(psi: float, delta: float, alpha=0.05, power=0.8) -> float:
    za, zb = norm.ppf(1 - alpha / 2), norm.ppf(power)
    return (za * np.sqrt(psi) + zb * np.sqrt(psi - delta ** 2)) ** 2 / delta ** 2


@pytest.mark.parametrize("psi,delta", [(0.1, 0.03), (0.2, 0.05), (0.3, 0.08)])
def test_the_exact_power_at_connors_n_is_near_80_percent(psi, delta):
    n = int(np.ceil(_connor_n(psi, delta)))
    assert 0.74 < mcnemar_power(n, psi, delta) < 0.84  # the exact test is a little conservative
    assert mcnemar_power(4 * n, psi, delta) > 0.99 and mcnemar_power(n // 4, psi, delta) < 0.4


def test_the_power_matches_a_simulation_of_the_test():
    rng = np.random.default_rng(0)
    n, psi, delta = 120, 0.25, 0.1
    p10, p01 = (psi + delta) / 2, (psi - delta) / 2
    hits = 0
    for _ in range(2000):
        cells = rng.multinomial(n, [p10, p01, 1 - psi])
        b, c = cells[0], cells[1]
        hits += b + c > 0 and binomtest(int(b), int(b + c), 0.5).pvalue < 0.05
    assert mcnemar_power(n, psi, delta) == pytest.approx(hits / 2000, abs=0.03)


def test_the_mde_is_the_difference_where_the_power_reaches_80_percent():
    m = mcnemar_mde(400, 80)
    d = m["difference"]
    assert m["discordance"] == 0.2 and m["assumption"] == "observed discordance"
    assert mcnemar_power(400, 0.2, d) >= 0.8 > mcnemar_power(400, 0.2, d - 0.002)
    assert 0.055 < d < 0.065  # Connor's formula gives n = 400 at delta of about 0.06
    assert mcnemar_mde(1600, 320)["difference"] < d / 1.8  # four times the items: about half the MDE


def test_edges_no_discordance_and_too_few_items():
    m = mcnemar_mde(200, 0)
    assert m["discordance"] == pytest.approx(1 - 0.05 ** (1 / 200)) and "upper bound" in m["assumption"]
    assert m["difference"] is not None and m["difference"] >= m["discordance"] * 0.5
    assert mcnemar_mde(5, 2)["difference"] is None  # 5 pairs all one way give p = 0.0625: nothing is detectable
    assert mcnemar_mde(6, 2)["difference"] is not None
    assert mcnemar_mde(0, 0)["difference"] is None


def test_mcnemar_records_its_mde():
    base = [True] * 50 + [False] * 50
    cand = [True] * 45 + [False] * 5 + [True] * 3 + [False] * 47
    r = mcnemar_exact(base, cand)
    assert (r["base_only"], r["candidate_only"]) == (5, 3) and not r["significant"]
    assert r["mde"]["n"] == 100 and r["mde"]["discordance"] == 0.08


def test_the_report_says_what_a_not_significant_could_have_detected():
    from qbench.report.render import detectable
    assert detectable(mcnemar_mde(400, 80)).startswith("; this run could detect differences of 6.")
    assert "no difference could reach" in detectable(mcnemar_mde(5, 2))
    assert "95% upper bound" in detectable(mcnemar_mde(200, 0))
