"""What a Case may hold: each spec's parameters as a frozen dataclass (`Params`), each field's
type and range declared with it (`param`), and a budget on the elements a case's inputs allocate.

A Case carries its params as JSON (what a case file holds); a spec turns them into its dataclass
(`of`) and every reader takes fields from it. Replay checks a case file here before anything is
built (`parse`): a hand-edited or corrupted file (topk 10**9, a string where a count goes, an op
that does not exist) is a usage error with the reason, not gigabytes of allocation or a
traceback. The ranges are wider than any fuzz profile draws (every drawn case validates:
tests/test_hostile.py) and as wide as the kernels' contracts allow. A field with a default may be
left out of a file.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, TypeVar

from .numerics import Numerics

MAX_ELEMENTS = 2**31  # tensor elements a case's inputs (and their index candidates) may hold in all


@dataclass(frozen=True)
class Param:
    """A field's type and range: what `Params.parse` holds a case file's value to."""

    kind: type                         # int | float | bool | str | list
    lo: float | None = None
    hi: float | None = None
    choices: tuple = ()
    item: "Param | None" = None        # a list's elements
    max_len: int = 0
    nullable: bool = False             # JSON null allowed

    def problem(self, value: Any) -> str | None:
        if value is None:
            return None if self.nullable else "null"
        if self.kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        elif self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.kind is list:
            ok = isinstance(value, (list, tuple))
        else:
            ok = isinstance(value, self.kind)
        if not ok:
            what = {float: "a number", int: "an integer", bool: "true or false", str: "a string", list: "a list"}
            return f"{value!r:.40} is not {what[self.kind]}"
        if self.choices and value not in self.choices:
            return f"{value!r} is not one of {', '.join(map(str, self.choices))}"
        if self.lo is not None and not self.lo <= value <= self.hi:
            return f"{value!r} is outside [{self.lo:g}, {self.hi:g}]"
        if self.item is not None:
            if len(value) > self.max_len:
                return f"a list of {len(value)}, at most {self.max_len}"
            for i, x in enumerate(value):
                if (why := self.item.problem(x)) is not None:
                    return f"[{i}]: {why}"
        return None


def Int(lo: int, hi: int, **kw: Any) -> Param:
    return Param(int, lo, hi, **kw)


def Real(lo: float, hi: float, **kw: Any) -> Param:
    return Param(float, lo, hi, **kw)


def Flag(**kw: Any) -> Param:
    return Param(bool, **kw)


def OneOf(*choices: Any, **kw: Any) -> Param:
    return Param(type(choices[0]), choices=choices, **kw)


def Ints(lo: int, hi: int, max_len: int, **kw: Any) -> Param:
    return Param(list, item=Int(lo, hi), max_len=max_len, **kw)


def SubsetOf(*choices: str) -> Param:
    return Param(list, item=OneOf(*choices), max_len=len(choices))


def param(kind: Param, default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """A field of a Params dataclass, `kind` its type and range; with a `default` a case file may
    leave it out (a list's default is a tuple: params are immutable)."""
    return field(default=default, metadata={"param": kind}, **kw)


P = TypeVar("P", bound="Params")


@dataclass(frozen=True)
class Params:
    """A spec's parameters. Subclasses declare their fields with `param` and may override
    `elements` (what the inputs allocate, roughly) and `problem` (relations between fields)."""

    @classmethod
    def schema(cls) -> dict[str, Param]:
        """Every field's Param, by name."""
        return {f.name: f.metadata["param"] for f in dataclasses.fields(cls)}

    @classmethod
    def required(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)

    @classmethod
    def of(cls: type[P], data: Mapping[str, Any]) -> P:
        """The params of a case known to be valid (drawn, or checked by `parse`); lists become tuples."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    @classmethod
    def parse(cls: type[P], op: str, data: Mapping[str, Any]) -> P:
        """`of(data)`, or ValueError with the reason unless every field is of its type and within
        its range, none is unknown or missing, the fields agree and the inputs fit the budget."""
        schema = cls.schema()
        for name in data:
            if name not in schema:
                raise ValueError(f"{op}: unknown parameter {name!r}; known: {', '.join(sorted(schema))}")
        for name in sorted(cls.required() - set(data)):
            raise ValueError(f"{op}: parameter {name!r} is missing")
        for name, value in data.items():
            if (why := schema[name].problem(value)) is not None:
                raise ValueError(f"{op}: parameter {name}: {why}")
        params = cls.of(data)
        if (why := params.problem()) is not None:
            raise ValueError(f"{op}: {why}")
        if (elements := params.elements()) > MAX_ELEMENTS:
            raise ValueError(f"{op}: its inputs would hold ~{elements:.3g} elements, over the budget of "
                             f"{MAX_ELEMENTS:.3g} (a case file is data: sizes stay bounded)")
        return params

    def replace(self: P, **changes: Any) -> P:
        return dataclasses.replace(self, **changes)

    def elements(self) -> int:
        return 0

    def problem(self) -> str | None:
        return None

    def numerics(self) -> Numerics:
        """What the tolerance policy reads of the case: the fields it shares with `Numerics`."""
        return Numerics(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Numerics) if hasattr(self, f.name)})


def blocks(seq_lens, block: int) -> int:
    return sum(-(-n // block) for n in seq_lens) + 1


TOKENS, HEADS, TOPK, REQUESTS = Int(1, 2**16), Int(1, 128), Int(1, 2**14), Int(1, 4096)
BLOCK, PAD, ROWS = Int(1, 1024), Int(0, 1024), Int(1, 2**22)
SEQ_LENS = Ints(1, 2**22, 4096)
SM_SCALE = Real(1e-6, 100.0)
