"""The two-run judge of one group's metric on arrays: what `reports.drift.compare` (two runs) and
`reports.history` (every neighbouring pair of many runs) both call, so that a step of a history
reads the word the two-run report gives it. The callers align the cases (paired: element i of
`new` and of `old` is one case) and drop missing values; `worst_at` indexes the case that moved
most (in `new`; None where there is none)."""

from __future__ import annotations

import numpy as np

from mla_verify.reports.bias import judge
from mla_verify.reports.significance import exceeds, mean_interval, more_often_nonzero, shift_interval
from mla_verify.reports.stats import quantile, quantiles
from mla_verify.reports.words import bias_word, paired_moves, unpaired_moves

DRIFT, NOT_BITWISE, IMPROVED = "drift", "no longer bitwise", "improved"


def _spread(new: np.ndarray, old: np.ndarray) -> dict:
    (base_p50, base_p99), (cur_p50, cur_p99) = quantiles(old, (0.5, 0.99)), quantiles(new, (0.5, 0.99))
    return {"base_p50": base_p50, "cur_p50": cur_p50, "base_p99": base_p99, "cur_p99": cur_p99}


def paired(new: np.ndarray, old: np.ndarray, floor: float, factor: float, alpha: float) -> dict:
    """Per-case ratios new / old raised to the floor: drift when their median exceeds the factor,
    improved below 1 / factor, else `words.paired_moves`; a case 0 in the baseline and not now
    is "no longer bitwise"."""
    lost = (old == 0) & (new > 0)
    if floor > 0:
        ratio = np.maximum(new, floor) / np.maximum(old, floor)
    else:                        # exact contracts: a ratio only where the baseline mismatched
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(old > 0, new / old, np.nan)
    finite = ~np.isnan(ratio)
    at = (int(np.flatnonzero(lost)[0]) if lost.any() else None if not finite.any()
          else int(np.argmax(ratio)) if finite.all() else int(np.nanargmax(ratio)))
    moves = paired_moves(ratio, alpha)
    word, med = moves.pop("word"), moves.pop("median")
    return {**_spread(new, old), "bitwise_lost": int(lost.sum()), "p_value": np.nan, "ratio": med,
            "worst_ratio": float(ratio[at]) if at is not None else np.nan, "worst_at": at, **moves,
            "finding": (NOT_BITWISE if lost.any() else DRIFT if med > factor
                        else IMPROVED if med < 1 / factor else word)}


def unpaired(new: np.ndarray, old: np.ndarray, floor: float, factor: float, alpha: float, judged: bool,
             tail_alpha: float) -> dict:
    """The p99 ratio shown; judged (enough cases a side) by the rank test of new > factor x old,
    Fisher's test for lost bitwise equality, else `words.unpaired_moves` (its tail test at
    `tail_alpha`)."""
    p99_old = np.float64(quantile(np.maximum(old, floor), 0.99))   # numpy division: x / 0 is inf or NaN
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = float(quantile(np.maximum(new, floor), 0.99) / p99_old)
        worst = float(np.maximum(new, floor).max() / p99_old) if new.size else np.nan
    rec = {**_spread(new, old), "ratio": ratio, "worst_ratio": worst,
           "worst_at": int(np.argmax(new)) if new.size else None, "p_value": np.nan, "bitwise_lost": 0, "finding": ""}
    if not judged or not new.size or not old.size:
        return rec
    nonzero = int((new > 0).sum())
    if (old == 0).all() and nonzero:
        rec["bitwise_lost"] = nonzero
        rec["p_value"] = more_often_nonzero(nonzero, new.size, 0, old.size)
        rec["finding"] = NOT_BITWISE if rec["p_value"] < alpha else ""
        return rec
    rec["p_value"] = exceeds(new, old, factor, floor)
    moves = unpaired_moves(new, old, floor, alpha, tail_alpha)
    word = moves.pop("word")
    rec.update(moves)
    rec["finding"] = (DRIFT if rec["p_value"] < alpha else IMPROVED if exceeds(old, new, factor, floor) < alpha
                      else word)
    return rec


def signed(new: np.ndarray, old: np.ndarray, floor: float, is_paired: bool, judged: bool, confidence: float) -> dict:
    """A bias metric's shift of the mean (paired: of the per-case differences), its t interval and
    p-value; drift when the whole interval lies beyond the floor, else `words.bias_word`."""
    nan = np.nan
    if is_paired:
        shift, ci, p = mean_interval(new - old, confidence)
        ahead = new - old
    else:
        shift, ci, p = shift_interval(new, old, confidence)
        ahead = new
    rec = {"base_p50": nan, "cur_p50": nan, "base_p99": nan, "cur_p99": nan, "ratio": nan, "worst_ratio": nan,
           "worst_at": None, "bitwise_lost": 0, "floor": floor, "finding": "", "p_value": p,
           "base_mean": float(old.mean()) if len(old) else nan, "cur_mean": float(new.mean()) if len(new) else nan,
           "shift": shift, "shift_ci": ci}
    if len(ahead) and np.isfinite(shift):
        rec["worst_at"] = int(np.argmax(np.sign(shift or 1.0) * ahead))
    if judged and judge(shift, ci, floor):
        rec["finding"] = IMPROVED if abs(rec["cur_mean"]) + floor < abs(rec["base_mean"]) else DRIFT
    elif judged:
        rec["finding"] = bias_word(shift, ci, floor, rec["base_mean"], rec["cur_mean"])
    return rec


def metric(new: np.ndarray, old: np.ndarray, floor: float, *, is_signed: bool, is_paired: bool, judged: bool,
           factor: float, confidence: float, tail_tests: int = 1) -> dict:
    """One metric of a group's two sides: `signed` for a bias metric, else `paired` or `unpaired`;
    `tail_tests`: the group's unpaired tail tests, which share 1 - confidence between them."""
    if is_signed:
        return signed(new, old, floor, is_paired, judged, confidence)
    if is_paired:
        return paired(new, old, floor, factor, 1.0 - confidence)
    return unpaired(new, old, floor, factor, 1.0 - confidence, judged, (1.0 - confidence) / tail_tests)
