"""Tests that know their sample size, for drift between runs whose cases do not pair (numpy only).

`exceeds` is a one-sided Mann-Whitney rank test: are the new values larger than `factor` times
the old ones? Under its null hypothesis the new values come from the old distribution scaled by
the factor, so a run of the same kernel on other cases (ratio about 1) sits far inside it, and a
group flags only when its new values rank above the scaled old ones more often than chance allows
at its sample sizes. Small samples get the exact permutation distribution of the rank sum (ties
take average ranks), larger ones the normal approximation with the tie correction.

`more_often_nonzero` is Fisher's exact test of "bitwise in the baseline, not any more": do more of
the new cases differ from the reference at all than the old ones did?
"""

from __future__ import annotations

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


def more_often_nonzero(new_nonzero: int, n_new: int, old_nonzero: int, n_old: int) -> float:
    """Fisher's exact one-sided p-value that the new cases are nonzero more often than the old:
    P(X >= new_nonzero), X hypergeometric over the pooled cases."""
    total, nonzero = n_new + n_old, new_nonzero + old_nonzero
    ways = math.comb(total, n_new)
    hits = sum(math.comb(nonzero, k) * math.comb(total - nonzero, n_new - k)
               for k in range(new_nonzero, min(nonzero, n_new) + 1))
    return hits / ways if ways else 1.0
