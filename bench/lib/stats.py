"""Small-sample statistics for paired benchmark comparisons, over SciPy's Student t.

A paired design (every arm of a seed shares initialisation and data order with that seed's
reference arm) turns run-to-run noise into a per-seed difference; its mean gets a
Student-t 95% confidence interval, a two-sided p-value (SciPy's one-sample t test of the
differences, which is the paired t test), and the minimum detectable effect says how large a
true difference the design would have resolved (80% power, two-sided 5% level). A claim picked
from a family of comparisons ("the first bit width that costs loss") is made only where Holm's
step-down procedure rejects, so the family's error rate stays at 5%.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from scipy import stats as scipy_stats


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    return float(scipy_stats.t.cdf(t, df))


def t_quantile(p: float, df: int) -> float:
    """The `p` quantile of Student's t."""
    return float(scipy_stats.t.ppf(p, df))


@dataclass
class Paired:
    """Mean of per-seed differences with its 95% CI (t-based) and the 80%-power minimum
    detectable effect; `resolved` when the CI excludes zero."""

    mean: float
    std: float
    n: int
    ci95: float  # half-width
    mde80: float
    p: float  # two-sided p-value of the paired t test (nan below 2 seeds)

    @property
    def resolved(self) -> bool:
        return self.n > 1 and abs(self.mean) > self.ci95

    def as_dict(self) -> dict[str, float | int | bool]:
        return {**asdict(self), "resolved": self.resolved}


def paired(diffs: list[float]) -> Paired:
    """Statistics of a list of per-seed differences."""
    n = len(diffs)
    mean = statistics.fmean(diffs)
    if n < 2:
        return Paired(mean, math.nan, n, math.nan, math.nan, math.nan)
    sd = statistics.stdev(diffs)
    se = sd / math.sqrt(n)
    half = t_quantile(0.975, n - 1) * se
    if se == 0:  # no spread: SciPy's t statistic is undefined; a constant nonzero difference is certain
        p = 0.0 if mean != 0 else 1.0
    else:
        p = float(scipy_stats.ttest_1samp(diffs, 0.0).pvalue)
    return Paired(mean, sd, n, half, (t_quantile(0.975, n - 1) + t_quantile(0.80, n - 1)) * se, p)


def holm(pvalues: list[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down rejections for a family of tests, in the input's order.

    Sort the p-values ascending; reject the k-th smallest (k = 0, 1, ...) while
    p_(k) <= alpha / (m - k), stop at the first that fails. Controls the family-wise error rate
    at `alpha` under any dependence between the tests (the arms of a seed share its fp32 run).
    A nan p-value (fewer than 2 seeds) counts as never rejected.
    """
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: (math.isnan(pvalues[i]), pvalues[i]))
    rejected = [False] * m
    for k, i in enumerate(order):
        if math.isnan(pvalues[i]) or pvalues[i] > alpha / (m - k):
            break
        rejected[i] = True
    return rejected


def ratio_ci(num: list[float], den: list[float]) -> tuple[float, float] | None:
    """Fieller's 95% confidence interval for mean(num) / mean(den) from paired samples.

    Used for the share of a loss gap that GIFT closes, `(euclid - gift) / (euclid - fp32)`
    per seed, whose numerator and denominator share the Euclidean arm and so are correlated.
    Returns None when the denominator's mean is not resolved from zero (the interval is then
    unbounded: no share can be claimed), or with fewer than 3 seeds.
    """
    n = len(num)
    if n != len(den) or n < 3:
        return None
    mx, my = statistics.fmean(num), statistics.fmean(den)
    sxx = statistics.variance(num) / n
    syy = statistics.variance(den) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(num, den)) / (n - 1) / n
    t2 = t_quantile(0.975, n - 1) ** 2
    # (mx - r my)^2 <= t^2 (sxx - 2 r sxy + r^2 syy)  <=>  a r^2 + b r + c <= 0
    a = my * my - t2 * syy
    b = -2.0 * (mx * my - t2 * sxy)
    c = mx * mx - t2 * sxx
    if a <= 0:  # the denominator's CI contains zero
        return None
    disc = b * b - 4.0 * a * c
    if disc < 0:
        return None
    root = math.sqrt(disc)
    return ((-b - root) / (2.0 * a), (-b + root) / (2.0 * a))


def median_ci(xs: Sequence[float], level: float = 0.95) -> dict[str, float | int | str]:
    """The median of `xs` and its distribution-free confidence interval from order statistics:
    the narrowest symmetric pair of ranks (j, n+1-j) whose binomial(n, 1/2) coverage is at
    least `level`. Below n = 6 no pair reaches 95%: the interval is then the range and
    `coverage` says what it covers (1 - 2^(1-n))."""
    s = sorted(xs)
    n = len(s)
    if n == 0:
        raise ValueError("median_ci: no samples")
    j, cov = 1, 1 - 2 * 0.5 ** n  # the range (ranks 1 and n)
    for k in range(n // 2, 0, -1):  # widen from the middle until the coverage reaches `level`
        c = sum(math.comb(n, i) for i in range(k, n - k + 1)) / 2 ** n
        if c >= level:
            j, cov = k, c
            break
    return {"median": statistics.median(s), "lo": s[j - 1], "hi": s[n - j], "rank_lo": j, "rank_hi": n + 1 - j,
            "n": n, "coverage": cov,
            "method": "order statistic (binomial)"}
