"""Tests that know their sample size, for drift between runs whose cases do not pair (numpy only).

`exceeds` is a one-sided Mann-Whitney rank test: are the new values larger than `factor` times
the old ones? Under its null hypothesis the new values come from the old distribution scaled by
the factor, so a run of the same kernel on other cases (ratio about 1) sits far inside it, and a
group flags only when its new values rank above the scaled old ones more often than chance allows
at its sample sizes. Small samples get the exact permutation distribution of the rank sum (ties
take average ranks), larger ones the normal approximation with the tie correction.

`more_often_nonzero` is Fisher's exact test of "bitwise in the baseline, not any more": do more of
the new cases differ from the reference at all than the old ones did?

`mean_interval` and `shift_interval` are Student t intervals for signed statistics (bias: one value
per case, `equivalence.judge.policy.BIAS_METRICS`): the mean of one sample (or of paired differences), and
the difference of two means by Welch's test. Cases are the samples; their means are close to normal
well before the 60 cases a bias is looked for at, and a t interval knows how few it has.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pandas as pd

# Up to this many ways of choosing the new sample from the pooled one, the permutation
# distribution is enumerated (C(16, 8) = 12870: every group of up to 8 + 8 cases is exact).
_EXACT_LIMIT = 20_000


def smallest_p(n_new: int, n_old: int) -> float:
    """The smallest p-value the rank test can give at these sample sizes: 1 / C(n, n_new)."""
    return 1.0 / math.comb(n_new + n_old, n_new) if n_new and n_old else 1.0


def _rank_sum_p(ranks: np.ndarray, n_new: int) -> float:
    """P(rank sum of a random n_new-subset >= the observed one, the first n_new ranks)."""
    observed = ranks[:n_new].sum()
    n = ranks.size
    if math.comb(n, n_new) <= _EXACT_LIMIT:
        subsets = np.fromiter(itertools.chain.from_iterable(itertools.combinations(range(n), n_new)),
                              dtype=np.int64).reshape(-1, n_new)
        sums = ranks[subsets].sum(axis=1)
        return float(np.mean(sums >= observed - 1e-9))
    n_old = n - n_new
    mean = n_new * (n + 1) / 2
    _, counts = np.unique(ranks, return_counts=True)
    var = n_new * n_old / 12 * ((n + 1) - float((counts**3 - counts).sum()) / (n * (n - 1)))
    if var <= 0:
        return 1.0
    z = (observed - mean - 0.5) / math.sqrt(var)   # continuity correction
    return 0.5 * math.erfc(z / math.sqrt(2))


def exceeds(new: np.ndarray, old: np.ndarray, factor: float, floor: float) -> float:
    """One-sided p-value that `new` is stochastically larger than `factor * old`, both raised to
    `floor` first (differences below it are rounding residue). NaN values are left out; 1.0
    where a side is empty."""
    a = np.maximum(np.asarray(new, dtype="float64"), floor)
    b = factor * np.maximum(np.asarray(old, dtype="float64"), floor)
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    if not a.size or not b.size:
        return 1.0
    ranks = pd.Series(np.concatenate([a, b])).rank(method="average").to_numpy()
    return _rank_sum_p(ranks, a.size)


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified
    Lentz, as Numerical Recipes' betacf), which converges fast for x below (a + 1) / (a + b + 2)."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _betainc(b, a, 1.0 - x)
    tiny = 1e-300
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),            # the even step
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # the odd step
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * f


def t_two_sided(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with df degrees of freedom."""
    return _betainc(df / 2, 0.5, df / (df + t * t)) if math.isfinite(t) else 0.0


@functools.lru_cache(maxsize=4096)   # a history asks for the same few (confidence, cases) thousands of times
def t_quantile(confidence: float, df: float) -> float:
    """The half-width, in standard errors, of a two-sided t interval at `confidence` (bisection)."""
    lo, hi = 0.0, 1.0
    while t_two_sided(hi, df) > 1 - confidence:
        lo, hi = hi, 2 * hi
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided(mid, df) > 1 - confidence else (lo, mid)
    return hi


def _interval(estimate: float, se: float, df: float, confidence: float) -> tuple[float, float, float]:
    if se == 0:
        return estimate, 0.0, 1.0 if estimate == 0 else 0.0
    return estimate, t_quantile(confidence, df) * se, t_two_sided(estimate / se, df)


def _clean(values) -> np.ndarray:
    v = np.asarray(values, dtype="float64")
    return v[np.isfinite(v)]


def mean_interval(values, confidence: float) -> tuple[float, float, float]:
    """(mean, half-width of its t interval at `confidence`, two-sided p-value of mean 0) of one
    sample (non-finite values left out); the half-width and p are NaN below 2 values."""
    v = _clean(values)
    if v.size < 2:
        return (float(v.mean()) if v.size else math.nan), math.nan, math.nan
    return _interval(float(v.mean()), float(v.std(ddof=1)) / math.sqrt(v.size), v.size - 1, confidence)


def shift_interval(new, old, confidence: float) -> tuple[float, float, float]:
    """(mean(new) - mean(old), half-width of Welch's t interval at `confidence`, two-sided p-value
    of no shift); the half-width and p are NaN with fewer than 2 values a side."""
    a, b = _clean(new), _clean(old)
    if a.size < 2 or b.size < 2:
        return (float(a.mean() - b.mean()) if a.size and b.size else math.nan), math.nan, math.nan
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1)) if se else 1.0
    return _interval(float(a.mean() - b.mean()), se, df, confidence)


def more_often_nonzero(new_nonzero: int, n_new: int, old_nonzero: int, n_old: int) -> float:
    """Fisher's exact one-sided p-value that the new cases are nonzero more often than the old:
    P(X >= new_nonzero), X hypergeometric over the pooled cases."""
    total, nonzero = n_new + n_old, new_nonzero + old_nonzero
    ways = math.comb(total, n_new)
    hits = sum(math.comb(nonzero, k) * math.comb(total - nonzero, n_new - k)
               for k in range(new_nonzero, min(nonzero, n_new) + 1))
    return hits / ways if ways else 1.0
