"""Four words for a group compared with its baseline (issue 39): `drifted` (beyond the factor:
fails the run), `worse` and `better` (a significant, material change within the factor: never
fails the run unless asked, `--fail-on worse`), `unchanged`.

A drift metric's ratios (each value first raised to its floor, `reports.drift`) are judged twice,
each test at the drift confidence and deterministic (no resampling):

  median   paired: the sign test of the cases that moved (more up than down?), worse when it is
           significant and the median ratio reaches WORSE_MEDIAN.
  tail     paired: the sign test of the cases that moved by WORSE_TAIL or more, up against down: a
           kernel whose typical case is unchanged and whose worst tenth doubled is worse.
  unpaired (no case shared) the rank test of new > WORSE_TAIL x old. Tails are not compared: two
           draws of cases differ in their mix of shapes, and a reseeded v1's largest bound use fell
           from 0.47 to 0.22 with no change of kernel (Fisher's test of cases beyond 1.25 x the
           baseline's p90 called that "better", p = 0.003).

`better` is the mirror of each. A rerun of one kernel on its own cases moves nothing (every ratio
is 1): unchanged. A bias metric's shift (gain, bias_units) reads worse when its whole t interval
lies beyond WORSE_BIAS_SHARE of its floor, away from 0 (`bias_word`).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from mla_verify.equivalence.judge.policy import WORSE_BIAS_SHARE, WORSE_MEDIAN, WORSE_TAIL
from mla_verify.reports.bias import judge
from mla_verify.reports.significance import exceeds
from mla_verify.reports.stats import quantile, quantiles

DRIFTED, WORSE, UNCHANGED, BETTER = "drifted", "worse", "unchanged", "better"
WORDS = (DRIFTED, WORSE, UNCHANGED, BETTER)


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


def unpaired_moves(new: np.ndarray, old: np.ndarray, floor: float, alpha: float) -> dict:
    """Values of two runs that share no case -> as `paired_moves` by the rank test of new > WORSE_TAIL x
    old (both raised to the floor); p90_ratio is the ratio of their p90s, and no case moved: none pairs."""
    a = np.maximum(np.asarray(new, dtype="float64"), floor)
    b = np.maximum(np.asarray(old, dtype="float64"), floor)
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    if not a.size or not b.size:
        return {"p90_ratio": np.nan, "moved_up": np.nan, "moved_down": np.nan, "p_moved": np.nan, "word": ""}
    word, p = _word(exceeds(a, b, WORSE_TAIL, floor), exceeds(b, a, WORSE_TAIL, floor), alpha)
    with np.errstate(divide="ignore", invalid="ignore"):
        p90 = float(np.float64(quantile(a, 0.9)) / np.float64(quantile(b, 0.9)))
    return {"p90_ratio": p90, "moved_up": np.nan, "moved_down": np.nan, "p_moved": p, "word": word}


def bias_word(shift: float, ci: float, floor: float, base_mean: float, cur_mean: float) -> str:
    """A bias metric's shift within its drift floor: worse (better) when its whole interval lies beyond
    WORSE_BIAS_SHARE of the floor and the mean moved away from (toward) 0."""
    if not judge(shift, ci, WORSE_BIAS_SHARE * floor):
        return ""
    return WORSE if abs(cur_mean) > abs(base_mean) else BETTER


def group_word(findings: list[str], flags: tuple[str, ...], improved: str, compared: bool) -> str:
    """The group's word from its metrics' findings: any flag drifted, else any worse, else better."""
    if any(f in flags for f in findings):
        return DRIFTED
    if WORSE in findings:
        return WORSE
    if BETTER in findings or improved in findings:
        return BETTER
    return UNCHANGED if compared else ""
