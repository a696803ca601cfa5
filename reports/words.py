"""Four words for a group compared with its baseline (issue 39): `drifted` (beyond the factor:
fails the run), `worse` and `better` (a significant, material change within the factor: never
fails the run unless asked, `--fail-on worse`), `unchanged`.

A drift metric's ratios (each value first raised to its floor, `reports.drift`) are judged twice,
each test at the drift confidence and deterministic (no resampling):

  median   paired: the sign test of the cases that moved (more up than down?), worse when it is
           significant and the median ratio reaches WORSE_MEDIAN.
  tail     paired: the sign test of the cases that moved by WORSE_TAIL or more, up against down: a
           kernel whose typical case is unchanged and whose worst tenth doubled is worse.
  unpaired (no case shared) the rank test of new > WORSE_TAIL x old, and the tail test
           (`tail_moves`): Fisher's exact test of the cases above the pooled TAIL_QUANTILE, worse
           when new ones sit there more often and the p90 grew by WORSE_TAIL or more, at the
           confidence shared out over the group's metrics (Bonferroni: one group, one chance). It
           compares two draws' tails by rank against one threshold, never a run's largest value
           (a reseeded v1's largest bound use fell from 0.47 to 0.22 with no change of kernel).
           Below about 22 cases a side it cannot reach its level (`tail_p_min`): the tails of such
           draws were not compared, and a group judged on them alone reads NOT_COMPARABLE, never
           unchanged.

`better` is the mirror of each. A rerun of one kernel on its own cases moves nothing (every ratio
is 1): unchanged. A bias metric's shift (gain, bias_units) reads worse when its whole t interval
lies beyond WORSE_BIAS_SHARE of its floor, away from 0 (`bias_word`).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from mla_verify.equivalence.judge.policy import TAIL_QUANTILE, WORSE_BIAS_SHARE, WORSE_MEDIAN, WORSE_TAIL
from mla_verify.reports.bias import judge
from mla_verify.reports.significance import exceeds, more_often_nonzero
from mla_verify.reports.stats import quantile, quantiles

DRIFTED, WORSE, UNCHANGED, BETTER = "drifted", "worse", "unchanged", "better"
NOT_COMPARABLE = "not comparable"   # most cases unshared and too few to compare their tails
WORDS = (DRIFTED, WORSE, UNCHANGED, BETTER, NOT_COMPARABLE)
RANK_TEST, TAIL_TEST = f"rank test of x{WORSE_TAIL:g}", f"tail test: cases above the pooled p{TAIL_QUANTILE * 100:g}"


@functools.lru_cache(maxsize=65536)
def sign_p(ups: int, downs: int) -> float:
    """The sign test's one-sided p-value of more ups than downs: P(Binomial(ups + downs, 1/2) >= ups)."""
    n = ups + downs
    if n == 0:
        return 1.0
    return math.fsum(math.comb(n, k) for k in range(ups, n + 1)) / 2.0**n


def _word(p_worse: float, p_better: float, alpha: float) -> tuple[str, float]:
    if p_worse < alpha:
        return WORSE, p_worse
    if p_better < alpha:
        return BETTER, p_better
    return "", min(p_worse, p_better)


def paired_moves(ratio: np.ndarray, alpha: float) -> dict:
    """Per-case ratios (new / old, floored; NaN left out) -> median, p90_ratio, moved_up / moved_down (cases
    that moved by WORSE_TAIL or more each way), word (worse, better or "") and p_moved (its p-value;
    for "" the smaller of the two)."""
    r = np.sort(np.asarray(ratio, dtype="float64"))
    r = r[~np.isnan(r)]
    if not r.size:
        return {"median": np.nan, "p90_ratio": np.nan, "moved_up": 0, "moved_down": 0, "p_moved": np.nan, "word": ""}
    half = r.size // 2
    med = float(r[half] if r.size % 2 else (r[half - 1] + r[half]) / 2)   # np.median of the sorted ratios
    gt, lt = int((r > 1).sum()), int((r < 1).sum())
    up, down = int((r >= WORSE_TAIL).sum()), int((r <= 1 / WORSE_TAIL).sum())
    p_worse = min(sign_p(gt, lt) if med >= WORSE_MEDIAN else 1.0, sign_p(up, down))
    p_better = min(sign_p(lt, gt) if med <= 1 / WORSE_MEDIAN else 1.0, sign_p(down, up))
    word, p = _word(p_worse, p_better, alpha)
    return {"median": med, "p90_ratio": quantiles(r, (0.9,))[0], "moved_up": up, "moved_down": down, "p_moved": p, "word": word}


def tail_p_min(n_new: int, n_old: int) -> float:
    """The smallest p-value the tail test can give at these sizes (distinct values): every case above
    the pooled TAIL_QUANTILE in the new run, C(n_new, m) / C(n, m)."""
    n = n_new + n_old
    above = n - 1 - math.ceil(TAIL_QUANTILE * (n - 1)) if n else 0   # the order statistic `quantile` takes
    return math.comb(n_new, above) / math.comb(n, above) if 0 < above <= n_new else 1.0


def tails_compared(n_new: int, n_old: int, alpha: float) -> bool:
    """Whether the tail test can find a move either way at `alpha` with this many cases a side."""
    return max(tail_p_min(n_new, n_old), tail_p_min(n_old, n_new)) < alpha


@functools.lru_cache(maxsize=64)
def tail_cases(alpha: float) -> int:
    """The fewest cases a side with which the tail test can find a move at `alpha`."""
    return next(n for n in range(2, 100_000) if tails_compared(n, n, alpha))


def tail_moves(new: np.ndarray, old: np.ndarray) -> dict:
    """Two runs' values (raised to the floor, no NaN) -> p_worse, p_better and p90_ratio: Fisher's exact
    test of the cases above the pooled TAIL_QUANTILE, each way; a way counts only where the p90 moved
    by WORSE_TAIL or more that way (material)."""
    t = quantile(np.concatenate([new, old]), TAIL_QUANTILE)
    up, down = int((new > t).sum()), int((old > t).sum())
    with np.errstate(divide="ignore", invalid="ignore"):
        p90 = float(np.float64(quantile(new, 0.9)) / np.float64(quantile(old, 0.9)))
    return {"p_worse": more_often_nonzero(up, new.size, down, old.size) if p90 >= WORSE_TAIL else 1.0,
            "p_better": more_often_nonzero(down, old.size, up, new.size) if p90 <= 1 / WORSE_TAIL else 1.0,
            "p90_ratio": p90}


def unpaired_moves(new: np.ndarray, old: np.ndarray, floor: float, alpha: float, tail_alpha: float) -> dict:
    """Values of two runs that share no case -> as `paired_moves` by the rank test of new > WORSE_TAIL x
    old (both raised to the floor) at `alpha`, or the tail test (`tail_moves`) at `tail_alpha`; p90_ratio
    is the ratio of their p90s, moved_by the test behind p_moved, and no case moved: none pairs."""
    a = np.maximum(np.asarray(new, dtype="float64"), floor)
    b = np.maximum(np.asarray(old, dtype="float64"), floor)
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    if not a.size or not b.size:
        return {"p90_ratio": np.nan, "moved_up": np.nan, "moved_down": np.nan, "p_moved": np.nan, "word": "",
                "moved_by": ""}
    rank = _word(exceeds(a, b, WORSE_TAIL, floor), exceeds(b, a, WORSE_TAIL, floor), alpha)
    tail = tail_moves(a, b)
    tail_word = _word(tail["p_worse"], tail["p_better"], tail_alpha)
    (word, p), by = (tail_word, TAIL_TEST) if tail_word[0] and not rank[0] else (rank, RANK_TEST)
    return {"p90_ratio": tail["p90_ratio"], "moved_up": np.nan, "moved_down": np.nan, "p_moved": p, "word": word,
            "moved_by": by}


def bias_word(shift: float, ci: float, floor: float, base_mean: float, cur_mean: float) -> str:
    """A bias metric's shift within its drift floor: worse (better) when its whole interval lies beyond
    WORSE_BIAS_SHARE of the floor and the mean moved away from (toward) 0."""
    if not judge(shift, ci, WORSE_BIAS_SHARE * floor):
        return ""
    return WORSE if abs(cur_mean) > abs(base_mean) else BETTER


def group_word(findings: list[str], flags: tuple[str, ...], improved: str, compared: bool,
               uncompared: str = "") -> str:
    """The group's word from its metrics' findings: any flag drifted, else any worse, else better, else
    unchanged, or NOT_COMPARABLE where `uncompared` says why most of its cases were not compared."""
    if any(f in flags for f in findings):
        return DRIFTED
    if WORSE in findings:
        return WORSE
    if BETTER in findings or improved in findings:
        return BETTER
    if not compared:
        return ""
    return NOT_COMPARABLE if uncompared else UNCHANGED
