"""Which rows of two runs compare with each other: implementations paired per op, then cases.

Implementations pair per op: an explicit `NEW=OLD` mapping first, then the same name in both
runs, and where each run holds a single implementation of the op, that one with the other's
whatever their names (`mykern_v2:decode` against `mykern_v1:decode`). Cases pair by case_id
within a group: the same op, path, tensor, deviation and paired implementations. A case's id is
its (op, params, seed), so a run that re-drew the baseline's seed meets every case again.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

PAIR_COLUMNS = ("op", "impl", "base_impl", "how")


class PairingError(ValueError):
    """A pairing asked for that the runs cannot give (`--pair` naming an absent implementation)."""


class NothingComparable(PairingError):
    """The two runs share no (op, implementation) pair: there is no drift to judge."""


def parse_pairs(specs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """["NEW=OLD", ...] -> {NEW: OLD}."""
    out = {}
    for spec in specs:
        new, sep, old = spec.partition("=")
        if not sep or not new or not old:
            raise PairingError(f"--pair {spec!r}: expected NEW=OLD (implementation names as the runs' rows spell them)")
        out[new] = old
    return out


def pair_implementations(current: pd.DataFrame, baseline: pd.DataFrame,
                         explicit: Mapping[str, str] | None = None) -> pd.DataFrame:
    """PAIR_COLUMNS: per op of both runs, each current implementation and the baseline one it is
    compared with, and how they were paired ("--pair", "same name", "one per op")."""
    explicit = dict(explicit or {})
    cur_impls, base_impls = set(current["impl"]), set(baseline["impl"])
    for new, old in explicit.items():
        if new not in cur_impls:
            raise PairingError(f"--pair {new}={old}: no implementation {new!r} in the run "
                             f"(it has {', '.join(sorted(cur_impls))})")
        if old not in base_impls:
            raise PairingError(f"--pair {new}={old}: no implementation {old!r} in the baseline "
                             f"(it has {', '.join(sorted(base_impls))})")
    cur_by_op = current.groupby("op", observed=True)["impl"].unique()
    base_by_op = baseline.groupby("op", observed=True)["impl"].unique()
    records = []
    for op in sorted(set(cur_by_op.index) & set(base_by_op.index)):
        news, olds = sorted(cur_by_op[op]), sorted(base_by_op[op])
        for new in news:
            if explicit.get(new) in olds:
                records.append((op, new, explicit[new], "--pair"))
            elif new in olds and new not in explicit:
                records.append((op, new, new, "same name"))
            elif len(news) == len(olds) == 1 and new not in explicit:
                records.append((op, new, olds[0], "one per op"))
    return pd.DataFrame.from_records(records, columns=list(PAIR_COLUMNS))


def unpaired_implementations(current: pd.DataFrame, baseline: pd.DataFrame,
                             pairs: pd.DataFrame) -> tuple[list[str], list[str]]:
    """("op impl" of the run, of the baseline) that were compared with nothing."""
    def left(frame: pd.DataFrame, column: str) -> list[str]:
        have = set(map(tuple, frame[["op", "impl"]].drop_duplicates().to_numpy()))
        used = set(zip(pairs["op"], pairs[column]))
        return [f"{op} {impl}" for op, impl in sorted(have - used)]

    return left(current, "impl"), left(baseline, "base_impl")


def with_partner(current: pd.DataFrame, baseline: pd.DataFrame,
                 pairs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Both runs' rows of paired implementations, each with `impl` (the current name) and
    `base_impl` (the baseline's), so that one group key fits both sides."""
    cur = current.merge(pairs[["op", "impl", "base_impl"]], on=["op", "impl"], how="inner")
    base = baseline.rename(columns={"impl": "base_impl"}).merge(
        pairs[["op", "impl", "base_impl"]], on=["op", "base_impl"], how="inner")
    return cur, base
