"""Shards: one run split into disjoint, deterministic shares, so that N machines (a CI matrix, a
Slurm array, an Indexed Job) together run exactly what one machine would have.

A run of N shards with P parts each (`--shard I/N --parallel P`) is T = N * P slots. Parts are the
shards of one host: part j of shard I is slot I * P + j of T, so `--parallel P` on one machine and
P machines of `--shard I/P` deal the same slots.

    fuzz   slot k is the campaign of seed S + k with `share(E, T)[k]` of the E examples
           (nothing when E < T leaves it none); one slot is the unsharded run itself
    gate   slot k runs every T-th of the gate's units, one unit being an op (or property) and
           an implementation with its corpus and campaigns, the multi-rank ones dealt first
           (the part of a host that holds them keeps every GPU for their ranks); every unit
           fuzzes with the run's seed S

The index comes from the caller (`--shard $SLURM_ARRAY_TASK_ID/N`): nothing reads a scheduler's
environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, order=True)
class Shard:
    """Shard `index` of `count` (0-based): "I/N" on the command line."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.index, int) and isinstance(self.count, int) and 0 <= self.index < self.count):
            raise ValueError(f"shard {self.index}/{self.count}: expected I/N with 0 <= I < N")

    @classmethod
    def parse(cls, text: "str | Shard | None") -> "Shard":
        """"I/N" (or a Shard; None: the whole run, 0/1); ValueError saying what is wrong."""
        if text is None:
            return cls()
        if isinstance(text, Shard):
            return text
        index, sep, count = str(text).partition("/")
        if not sep or not index.strip().isdigit() or not count.strip().isdigit():
            raise ValueError(f"shard {text!r}: expected I/N, e.g. 0/4 (I from 0 to N-1)")
        return cls(int(index), int(count))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def whole(self) -> bool:
        return self.count == 1

    def slots(self, parts: int) -> list["Shard"]:
        """This shard's parts on one host, each a shard of the whole run's N * P slots."""
        return [Shard(self.index * parts + j, self.count * parts) for j in range(parts)]

    def campaign(self, seed: int, examples: int) -> tuple[int, int]:
        """(seed, examples) of this slot's fuzz campaign; examples 0 when it has none."""
        shares = share(examples, self.count)
        return seed + self.index, shares[self.index] if self.index < len(shares) else 0

    def deal(self, units: Sequence[T], first: Sequence[bool] = ()) -> list[T]:
        """This slot's units, in their own order: every count-th of them, those flagged in `first`
        dealt before the rest."""
        flagged = [bool(f) for f in first] + [False] * (len(units) - len(first))
        order = sorted(range(len(units)), key=lambda i: not flagged[i])
        mine = set(order[self.index::self.count])
        return [u for i, u in enumerate(units) if i in mine]


def share(examples: int, parts: int) -> list[int]:
    """`examples` split over at most `parts` campaigns, none empty, the first ones one larger."""
    parts = max(1, min(parts, examples))
    return [examples // parts + (i < examples % parts) for i in range(parts)]
