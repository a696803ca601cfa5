"""What a run is, whatever starts it: `check()` and `mla-verify fuzz` (one op and implementation),
`gate()` and `mla-verify gate` (every op and implementation here), a part of either on one of this
host's GPUs (`runs.parts`), a shard of either on another machine. A `Run` holds it; `runs.driver`
runs it.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from mla_verify.equivalence import distributed
from mla_verify.equivalence.catalog import resolve_subject
from mla_verify.equivalence.profiles import Profile, get_profile
from mla_verify.equivalence.subject import Subject
from mla_verify.reports.meta import collect_meta

from .parts import Shard
from .rundir import RunDir

FUZZ, GATE = "fuzz", "gate"


@dataclass(frozen=True)
class Run:
    """What one run is. `examples`: fuzz, the whole run's cases (shared out over its campaigns);
    the gate, per unit (None: the profile's budgets)."""

    command: str                          # FUZZ or GATE
    ops: tuple[str, ...]                  # fuzz: its op; gate: what was asked (empty: every op and property)
    device: str                           # "cpu", "cuda" or "cuda:N"
    profile: Profile
    examples: int | None
    seed: int
    isolate: bool
    timeout: float
    out: RunDir | None = None             # the run directory being written
    baseline: Path | None = None          # the run whose cases these are again
    shard: Shard = Shard()
    parts: int = 1                        # this host's processes: the shard's slots (runs.parts)
    specs: tuple[str, ...] = ()           # fuzz: the implementation as --impl strings
    subject: Subject | None = None        # fuzz: the resolved implementation
    label: str = ""                       # fuzz: the rows' name for it
    deviations: tuple[str, ...] = ()
    conventions: tuple[str, ...] = ()     # fuzz: the implementation's declared conventions ("lse_base=2", ...)
    path: str | None = None
    world_size: int | None = None
    shrink: bool = True
    named: bool = True                    # every implementation importable in another process
    in_process: bool = False              # judged in the implementation's own process (not isolated, no ranks)
    invocation: str | None = None         # the command line that started it (meta.json's command)

    @property
    def op(self) -> str:
        return self.ops[0]

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def slots(self) -> list[Shard]:
        """The slots of the whole run this host runs, one per part."""
        return self.shard.slots(self.parts)

    @property
    def campaigns(self) -> list[tuple[int, int]]:
        """fuzz: (seed, examples) of each campaign this host runs."""
        return [c for c in (slot.campaign(self.seed, self.examples) for slot in self.slots) if c[1]]

    def options(self) -> dict[str, Any]:
        """The settings every shard of one run shares (`merge` checks them)."""
        common = {"command": self.command, "examples": self.examples, "seed": self.seed,
                  "profile": self.profile.name, "device": self.device_type, "isolate": self.isolate,
                  "timeout": self.timeout}
        if self.command == GATE:
            return {**common, "ops": list(self.ops) or None}
        return {**common, "op": self.op, "impl": list(self.specs), "path": self.path, "world_size": self.world_size,
                "deviations": list(self.deviations), "conventions": list(self.conventions), "shrink": self.shrink,
                "campaigns": self.shard.count * self.parts}

    def meta(self) -> dict[str, Any]:
        """meta.json: what `check(baseline=...)` and `gate --baseline` read back to draw the same
        cases (reports.meta.rerun_settings), and for a shard what `merge` checks."""
        if self.command == GATE:
            seeds, extra = [self.seed], {"examples": self.examples, "ops": list(self.ops) or None,
                                         "isolated": self.isolate}
        else:
            seeds = [s for s, _ in self.campaigns]
            extra = {"op": self.op, "examples": sum(n for _, n in self.campaigns), "path": self.path,
                     "isolated": not self.in_process, "deviations": list(self.deviations),
                     "conventions": list(self.conventions)}
        if not self.shard.whole:
            extra |= {"shard": str(self.shard), "run": self.options()}
        return collect_meta(self.profile.name, seeds, self.device, command=self.invocation, extra=extra)

    def part(self, slot: Shard, index: int, root: Path) -> "Run":
        """The Run of one part: its slot, in ROOT/part-INDEX. A fuzz part is the whole campaign of
        its slot's seed and examples."""
        here = dict(device=self.device_type, parts=1, out=root / f"part-{index}", baseline=None)
        if self.command == FUZZ:
            seed, examples = slot.campaign(self.seed, self.examples)
            return replace(self, seed=seed, examples=examples, shard=Shard(), **here)
        return replace(self, shard=slot, **here)

    def to_json(self) -> str:
        """A part's Run for its process (the subject is resolved again there from `specs`)."""
        plain = {f.name: getattr(self, f.name) for f in fields(self)
                 if f.name not in ("subject", "profile", "shard", "out", "baseline")}
        return json.dumps({**plain, "profile": self.profile.name, "shard": str(self.shard), "out": str(self.out)})

    @classmethod
    def from_json(cls, text: str) -> "Run":
        d = json.loads(text)
        d |= {"profile": get_profile(d["profile"]), "shard": Shard.parse(d["shard"]), "out": RunDir.open(d["out"]),
              **{k: tuple(d[k]) for k in ("ops", "specs", "deviations", "conventions")}}
        run = cls(**d)
        if run.command == FUZZ:
            run = replace(run, subject=resolve_subject(run.op, run.specs, run.device_type, deviations=run.deviations,
                                                       conventions=run.conventions))
        return run

    def header(self) -> str:
        """The line a run starts with."""
        where = f", run {self.out.path}" if self.out else ""
        if self.command == GATE:
            budget = (f"{self.examples}" if self.examples is not None
                      else f"{self.profile.examples} (properties: {self.profile.property_examples})")
            return (f"mla-verify gate: device {self.device}, profile {self.profile.name}, {budget} fuzz examples per "
                    f"op and implementation, seed {self.seed}{'' if self.shard.whole else f', shard {self.shard}'}"
                    f"{where}")
        ranks = ""
        if self.world_size:
            ranks = f", {self.world_size} ranks ({distributed.placement(self.world_size, self.device_type).describe()})"
        return (f"mla-verify fuzz: op {self.op}, implementation {self.label}, {self.examples} examples, profile "
                f"{self.profile.name}, device {self.device}, seed {self.seed}{ranks}{', isolated' if self.isolate else ''}"
                f"{where}" + (f"; the cases of baseline {self.baseline}" if self.baseline is not None else "")
                + ("" if self.shard.whole else f"; shard {self.shard} of {self.shard.count * self.parts} campaigns: "
                   + ", ".join(f"seed {s} x {n}" for s, n in self.campaigns)))


def invocation() -> str | None:
    """This process's command line as meta.json records it (None inside a bare interpreter)."""
    return shlex.join(["mla-verify"] + sys.argv[1:]) if sys.argv[1:] else None


