"""Covering arrays: the fewest rows that hold every combination of t factor values.

An op's discrete routing parameters (`Factor`s: s_q, top-k, heads, page size, ...) interact: a
dispatch table with no instance for s_q > 1 at top-k 256 shows only where both are drawn at once,
and each feature once is not enough. A covering array of strength t holds every t-tuple of values
of every t factors in some row: for t = 2, every pair. Its rows are found greedily (AETG: a row is
started from a tuple not held yet, each further factor, in a random order, takes the value that
completes the most tuples not held yet, and the best of a few such rows is kept), deterministic
from the generator it is handed. On a tie the value listed first wins: factors list their values
cheapest first, so a row's free factors take the cheap ones. `allowed` says which partial rows can
exist (DCP runs on the mixed path only): a tuple no row can hold is never asked for. With a `cost`
of a row (the interpreter's seconds for its case), a tuple whose cheapest row costs more than
`cap` is not asked for either (the profile's budget sizes the array), and of the rows grown the
one holding the most new tuples per second is kept.

An op declares its factors with `Pairs` (`coverage.registry`): the values each profile covers,
how a row becomes a case's params, and how a case's built tensors show the values (a case proves
what it holds, as it proves its features). Every value of a factor is held by some row: a small
discrete domain (rank counts 1-8, s_q 1-4) listed value by value is covered value by value.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

Value = Any
Row = dict[str, Value]
Tuple = tuple[tuple[str, Value], ...]  # ((factor, value), ...) in the factors' order
TRIES = 8                              # rows grown for each row kept
OVERHEAD_S = 0.1                       # a case's own cost besides its kernel's, in the cost's seconds


@dataclass(frozen=True)
class Factor:
    """A routing parameter of an op and the values a profile covers, cheapest first."""

    name: str
    values: tuple[Value, ...]


def anything(row: Mapping[str, Value]) -> bool:
    """Every combination can exist."""
    return True


def tuples(row: Mapping[str, Value], names: Sequence[str], strength: int) -> set[Tuple]:
    """The `strength`-tuples a (partial) row holds over the factors `names`, in their order."""
    present = [(n, row[n]) for n in names if n in row]
    return set(itertools.combinations(present, strength))


def universe(factors: Sequence[Factor], strength: int, allowed: Callable[[Mapping[str, Value]], bool] = anything
             ) -> set[Tuple]:
    """Every `strength`-tuple of the factors' values that a row may hold."""
    found = set()
    for group in itertools.combinations(factors, min(strength, len(factors))):
        for values in itertools.product(*(f.values for f in group)):
            tup = tuple(zip((f.name for f in group), values))
            if allowed(dict(tup)):
                found.add(tup)
    return found


def within(factors: Sequence[Factor], allowed: Callable[[Mapping[str, Value]], bool] = anything,
           cost: Callable[[Row], float] | None = None, cap: float | None = None
           ) -> Callable[[Mapping[str, Value]], bool]:
    """`allowed`, and where a `cost` and a `cap` are given, a (partial) row whose cheapest
    completion (each factor left its first allowed value) costs at most `cap`."""
    if cost is None or cap is None:
        return allowed

    def fits(row: Mapping[str, Value]) -> bool:
        if not allowed(row):
            return False
        whole = dict(row)
        for f in factors:
            if f.name not in whole:
                whole[f.name] = next((v for v in f.values if allowed({**whole, f.name: v})), f.values[0])
        return cost({f.name: whole[f.name] for f in factors}) <= cap

    return fits


def covering_array(factors: Sequence[Factor], strength: int, rng: random.Random,
                   allowed: Callable[[Mapping[str, Value]], bool] = anything, held: Iterable[Tuple] = (),
                   cost: Callable[[Row], float] | None = None, cap: float | None = None) -> list[Row]:
    """Rows (factor -> value) that hold, with the tuples `held` already, every `strength`-tuple
    of the factors' values that an allowed row within the cost cap may hold (the module
    docstring's greedy design)."""
    names = [f.name for f in factors]
    strength = min(strength, len(factors))
    fits = within(factors, allowed, cost, cap)
    missing = universe(factors, strength, fits) - set(held)
    rows = []
    while missing:
        ordered = sorted(missing, key=repr)
        best, score = None, 0.0
        for _ in range(TRIES):
            row = _grown(factors, names, strength, rng.choice(ordered), missing, rng, fits)
            found = len(tuples(row, names, strength) & missing) if row is not None else 0
            value = found / (OVERHEAD_S + cost(row)) if found and cost is not None else found
            if value > score:
                best, score = row, value
        if best is None:  # no allowed row completes the tuples tried: none is held
            break
        rows.append(best)
        missing -= tuples(best, names, strength)
    return rows


def _grown(factors: Sequence[Factor], names: Sequence[str], strength: int, start: Tuple, missing: set[Tuple],
           rng: random.Random, allowed: Callable[[Mapping[str, Value]], bool]) -> Row | None:
    """A whole row grown from the tuple `start`: the other factors in a random order, each given
    the allowed value completing the most missing tuples (the first listed on a tie)."""
    row = dict(start)
    rest = [f for f in factors if f.name not in row]
    rng.shuffle(rest)
    for f in rest:
        options = [v for v in f.values if allowed({**row, f.name: v})]
        if not options:
            return None
        row[f.name] = max(options, key=lambda v: (len(tuples({**row, f.name: v}, names, strength) & missing),
                                                  -f.values.index(v)))
    return {n: row[n] for n in names}


def named(tup: Tuple) -> str:
    """A tuple as `list --coverage` prints it: "s_q=2 x topk=256"."""
    return " x ".join(f"{name}={value}" for name, value in tup)
