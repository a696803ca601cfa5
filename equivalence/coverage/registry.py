"""What each op (or forward_mqa path) must reach: the registry of `Coverage`s that `features` (the
attention ops), `exact` (the exact ops) and `forward` (forward_mqa, dcp) fill on import and `sets`
reads (kept apart so the feature modules need nothing of the covering design above them)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..cases import layouts
from ..cases.profiles import Profile
from .pairs import Factor, Row, anything

Candidates = Callable[[random.Random, Profile], list[dict]]  # (rng from the seed, profile) -> params
Hits = Callable[[Any, dict], set[str]]                       # (typed params, built inputs) -> features


@dataclass(frozen=True)
class Pairs:
    """An op's discrete routing parameters, covered t at a time (`coverage.pairs`): the `factors`
    with the values a profile covers (cheapest first), how a row of values becomes a case's params
    (`realize`), which values a case's built inputs show (`shown`: a case proves what it holds),
    which partial rows can exist (`allowed`), the strength: the profile's (`Profile.strength`:
    pairs, triples where its budget holds them), at least `strength` (3 for an op whose cases cost
    next to nothing), and the interpreter's `cap` a case."""

    factors: Callable[[Profile], tuple[Factor, ...]]
    realize: Callable[[random.Random, Profile, Row], dict]
    shown: Callable[[Any, dict], Row]
    allowed: Callable[[Mapping[str, Any]], bool] = anything
    strength: int = 2
    # the interpreter's seconds a case of an interpreted campaign may take (None: unbounded): the
    # profile's `pair_s`, or for an op whose every case is a whole batch its draws' `interpreter_s`
    cap: Callable[[Profile], float | None] = lambda profile: profile.pair_s

    def strength_at(self, profile: Profile) -> int:
        return max(self.strength, profile.strength)


@dataclass(frozen=True)
class Coverage:
    """What an op (or a forward_mqa path) must reach: its `features`, the `candidates` a covering
    set is picked from, `hits`, the features a case's built inputs show, and the `pairs` of its
    routing parameters (None: it lists none)."""

    features: tuple[str, ...]
    candidates: Candidates
    hits: Hits
    pairs: Pairs | None = None


FEATURES: dict[tuple[str, str | None], Coverage] = {}  # (op, path or None) -> its coverage


def register(op: str, path: str | None, coverage: Coverage) -> Coverage:
    FEATURES[(op, path)] = coverage
    return coverage


def laid_out(op: str, coverage: Coverage) -> Coverage:
    """`coverage` of `op` with its layout features (`equivalence.cases.layouts`: one for each layout
    some input of the op may take, read back from the strides and offsets): every candidate
    proposed in each of those layouts."""
    kinds = [kind for kind in layouts.drawn(op) if kind != "contiguous"]

    def candidates(rng: random.Random, p: Profile) -> list[dict]:
        return [{**c, "layout": kind} for c in coverage.candidates(rng, p) for kind in kinds]

    def hits(params: Any, kw: dict) -> set[str]:
        return coverage.hits(params, kw) | layouts.shown(op, kw)

    return Coverage(coverage.features + layouts.features(op), candidates, hits, coverage.pairs)
