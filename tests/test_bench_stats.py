"""`bench.lib.stats` against values computed independently: printed t tables, a paired CI and a
p-value worked by hand, Fieller's interval by its defining inequality, Holm by its rule."""

from __future__ import annotations

import math

import pytest

from bench.lib.stats import holm, paired, ratio_ci, t_cdf, t_quantile

# two-sided 95% and one-sided 80% quantiles of Student's t (standard printed tables, 6 digits)
T_TABLE = [(0.975, 1, 12.706205), (0.975, 2, 4.302653), (0.975, 4, 2.776445), (0.975, 9, 2.262157),
           (0.975, 30, 2.042272), (0.80, 4, 0.940965), (0.80, 1, 1.376382), (0.95, 10, 1.812461)]


@pytest.mark.parametrize(("p", "df", "expected"), T_TABLE)
def test_t_quantile_matches_the_printed_table(p: float, df: int, expected: float) -> None:
    assert t_quantile(p, df) == pytest.approx(expected, abs=2e-6)
    assert t_cdf(expected, df) == pytest.approx(p, abs=1e-6)
    assert t_quantile(1 - p, df) == pytest.approx(-expected, abs=2e-6)  # symmetric


def test_t_cdf_closed_forms() -> None:
    # df = 1 is the Cauchy distribution: F(t) = 1/2 + atan(t)/pi; df = 2: 1/2 + t / (2 sqrt(2 + t^2))
    for t in (-3.0, -0.5, 0.0, 0.7, 4.0):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)


def test_paired_ci_and_p_value_on_a_hand_worked_sample() -> None:
    # diffs 1..5: mean 3, sd sqrt(2.5), se sqrt(0.5); half-width t(0.975, 4) se; t = 3 / sqrt(0.5)
    p = paired([1.0, 2.0, 3.0, 4.0, 5.0])
    se = math.sqrt(0.5)
    assert (p.mean, p.n) == (3.0, 5)
    assert p.std == pytest.approx(math.sqrt(2.5))
    assert p.ci95 == pytest.approx(2.776445 * se, rel=1e-6)
    assert p.mde80 == pytest.approx((2.776445 + 0.940965) * se, rel=1e-6)
    # P(|T_4| > 4.242641) = 0.013236 (table value)
    assert p.p == pytest.approx(0.013236, abs=2e-6)
    assert p.resolved
    # a difference whose CI straddles zero is not resolved; one seed gives no CI at all
    q = paired([1.0, -1.0, 0.5, -0.4])
    assert not q.resolved and q.p > 0.5
    one = paired([0.3])
    assert one.n == 1 and math.isnan(one.ci95) and math.isnan(one.p) and not one.resolved


def test_fieller_with_an_exact_denominator_reduces_to_a_scaled_t_interval() -> None:
    # den constant: syy = sxy = 0, the interval is (mean(num) +- t se(num)) / den
    num, den = [1.0, 2.0, 3.0], [2.0, 2.0, 2.0]
    lo, hi = ratio_ci(num, den)
    half = 4.302653 * math.sqrt(1.0 / 3.0)
    assert lo == pytest.approx((2.0 - half) / 2.0, rel=1e-6)
    assert hi == pytest.approx((2.0 + half) / 2.0, rel=1e-6)


def test_fieller_endpoints_satisfy_the_defining_equality() -> None:
    num = [0.010, 0.014, 0.011, 0.016, 0.012]
    den = [0.020, 0.026, 0.021, 0.030, 0.022]  # correlated with num
    lo, hi = ratio_ci(num, den)
    n = len(num)
    mx, my = sum(num) / n, sum(den) / n
    sxx = sum((x - mx) ** 2 for x in num) / (n - 1) / n
    syy = sum((y - my) ** 2 for y in den) / (n - 1) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(num, den)) / (n - 1) / n
    t2 = 2.776445 ** 2

    def excess(r: float) -> float:  # <= 0 inside the confidence set
        return (mx - r * my) ** 2 - t2 * (sxx - 2 * r * sxy + r * r * syy)

    assert lo < mx / my < hi
    assert excess(lo) == pytest.approx(0.0, abs=1e-12) and excess(hi) == pytest.approx(0.0, abs=1e-12)
    assert excess(mx / my) < 0 and excess(lo - 0.05) > 0 and excess(hi + 0.05) > 0


def test_fieller_refuses_an_unresolved_denominator_and_too_few_seeds() -> None:
    assert ratio_ci([1.0, 2.0, 3.0], [1.0, -1.0, 0.2]) is None
    assert ratio_ci([1.0, 2.0], [1.0, 1.1]) is None


def test_holm_step_down() -> None:
    # m = 4: thresholds 0.0125, 0.0167, 0.025, 0.05 on the sorted p-values
    assert holm([0.010, 0.04, 0.012, 0.030]) == [True, False, True, False]  # 0.030 > 0.025 stops the walk
    assert holm([0.010, 0.04, 0.012, 0.020]) == [True, True, True, True]
    assert holm([0.02, 0.001]) == [True, True]  # 0.001 <= 0.025, then 0.02 <= 0.05
    assert holm([0.03, 0.04]) == [False, False]  # each below 0.05 alone, but 0.03 > 0.05 / 2
    assert holm([0.001, math.nan]) == [True, False]  # a single seed never rejects
