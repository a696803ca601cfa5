"""What a run returns (`Outcome`): `mla_verify.check` and `mla_verify.replay` a `CheckResult` (the
rows, the verdict and, for a failure, the minimized case with everything needed to replay it),
`mla_verify.gate` a `GateOutcome`; `lines()` is what the CLI prints of either."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import pandas as pd

from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.judge.rows import QUIET_METRICS, FailureKind, Row
from mla_verify.equivalence.sandbox.device import device_type, is_cuda
from mla_verify.equivalence.subject import is_local
from mla_verify.reports.bias import bias_of
from mla_verify.reports.causes import lines as cause_lines, of_frame
from mla_verify.reports.meta import IN_PROCESS
from mla_verify.reports.stats import reached

DEFAULT_TIMEOUT_S = 300.0  # what an implementation may take per case in the isolation worker
RESULT_JSON = "result.json"  # a fuzz part's outcome (result_file)


class Outcome(Protocol):
    """What a run returns, fuzz or gate. Two types answer it, not one: a CheckResult is one
    implementation's verdict (its rows as a frame, each campaign's failure and its replay, a
    replay's `reproduced`), a GateOutcome many units' (the odd ones out, every finding's case file,
    an interrupted gate's rest); a field of one would be empty in the other."""

    out: Path | None                # the run directory, if one was written
    interrupted: bool               # Ctrl-C ended it early

    def lines(self) -> list[str]:
        """What the CLI prints of it: notes, findings, the verdict."""
        ...

    @property
    def exit_code(self) -> int:
        """What the CLI returns (`mla_verify.cli`'s codes: 0 pass, 1 discrepancy, 4 no verdict, 130)."""
        ...


@dataclass
class Failure:
    """A failing case: the (minimized) case, the failing row that decides it, and how to replay it."""

    case: Any                       # mla_verify.equivalence.case.Case
    tensor: str
    metric: str
    value: float
    bound: float
    reason: str
    rows: list[dict[str, Any]]      # every failing row of the case (Row records)
    case_file: Path | None
    replay_command: str             # "mla-verify replay FILE --impl ... --device ..."
    found_at: int | None = None     # example number of the first failing case
    seed: int | None = None         # the campaign's seed
    flaky: tuple[int, int] | None = None  # (failed k, of n re-runs) when a re-run passed
    minimized: bool = False
    from_corpus: bool = False       # a kept corpus's case (mla_verify.runs.corpus) that still fails
    unminimized: str = ""           # why it was not minimized, and how to have it minimized

    @classmethod
    def of(cls, case, rows, case_file: Path | None, replay_command: str, **fields: Any) -> "Failure":
        bad = [r for r in rows if not r.passed]
        first = bad[0]
        return cls(case, first.tensor, first.gate_metric, first.value, first.bound, first.reason,
                   [r.to_record() for r in bad], case_file, replay_command, **fields)

    def lines(self) -> list[str]:
        """The failure as the CLI prints it (after its first line)."""
        what = ("case from the corpus" if self.from_corpus else "minimized case" if self.minimized
                else "case (as found, not minimized)")
        out = [f"  {what}: {self.case.short()}"]
        if self.unminimized and not (self.minimized or self.from_corpus):
            out.append(f"  not minimized: {self.unminimized}")
        out += [f"  {Row.from_record(r).line()}" for r in self.rows]
        if self.case_file is not None:
            out.append(f"  case saved: {self.case_file}")
        out.append(f"  replay: {self.replay_command}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case.to_dict(), "tensor": self.tensor, "metric": self.metric, "value": self.value,
                "bound": self.bound, "reason": self.reason, "rows": self.rows,
                "case_file": None if self.case_file is None else str(self.case_file),
                "replay_command": self.replay_command, "found_at": self.found_at, "seed": self.seed,
                "flaky": list(self.flaky) if self.flaky else None, "minimized": self.minimized,
                "from_corpus": self.from_corpus, "unminimized": self.unminimized}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Failure":
        return cls(Case.from_dict(d["case"]), d["tensor"], d["metric"], d["value"], d["bound"], d["reason"],
                   list(d["rows"]), None if d["case_file"] is None else Path(d["case_file"]), d["replay_command"],
                   d.get("found_at"), d.get("seed"), tuple(d["flaky"]) if d.get("flaky") else None,
                   bool(d.get("minimized")), bool(d.get("from_corpus")), str(d.get("unminimized") or ""))


@dataclass
class CheckResult:
    """The outcome of `check` or `replay`."""

    op: str
    impl: str                       # the implementation's label in the rows
    passed: bool
    rows: pd.DataFrame              # the rows the run writes (`reports.load_run` reads the same)
    seed: int | None
    examples: int
    out: Path | None                # the run directory, if one was written
    failures: list[Failure] = field(default_factory=list)  # one per failing campaign (several with parallel parts)
    interrupted: bool = False       # Ctrl-C ended it early (the CLI exits 130)
    reproduced: bool | None = None  # replay: whether the saved failure came back
    notes: list[str] = field(default_factory=list)
    campaigns: int = 1              # independent campaigns (parallel parts: seeds seed, seed + 1, ...)
    in_process: bool = False        # judged in the implementation's own process (--no-isolate, a callable object)
    sandbox: str = ""               # isolated: what its workers stood behind ("sandbox auto: ...", sandbox.boundary)
    never_called: str = ""          # the replaced stages no case called (runs.driver): nothing judged what was asked
    covering: bool = True           # the op's covering set ran first (False: the draws alone, --no-covering-set)

    def __post_init__(self) -> None:
        if self.no_verdict:
            self.passed = False  # nothing judged is no pass

    @property
    def failure(self) -> Failure | None:
        """The failing case, or None."""
        return self.failures[0] if self.failures else None

    @property
    def no_verdict(self) -> str:
        """Why nothing judged what was asked (a replaced stage no case called; every case declined, or
        not judged for want of memory), else "": NO VERDICT, exit 4 (a failure says more)."""
        if self.failures or self.interrupted:
            return ""
        if self.never_called:
            return self.never_called
        if not len(self.rows) or not self.rows.gate_metric.isin(UNJUDGED).all():
            return ""
        return (f"{self.op} ({self.impl}): every one of its {self.rows.case_id.nunique()} cases was declined by the "
                f"implementation (mla_verify.unsupported) or not judged: nothing was judged")

    def report(self) -> str:
        """`lines()` as the CLI prints them."""
        return "\n".join(self.lines())

    def lines(self) -> list[str]:
        """What the CLI prints at the end: PASS with the least headroom (qualified when judged in
        the implementation's own process: it could reach the judge), or each failure with its
        minimized case, failing metric and bound, case file and replay command; then a warning per
        group biased against the reference (`reports.bias`: never a failure). Several failures are
        grouped by cause after them (`reports.causes`)."""
        lines = [f"note: {n}" for n in self.notes]
        for f in self.failures:
            kind = f"FLAKY DISCREPANCY (failed {f.flaky[0]} of {f.flaky[1]} re-runs)" if f.flaky else "DISCREPANCY"
            where = " from the corpus" if f.from_corpus else f" at example {f.found_at}" if f.found_at else ""
            seed = f", seed {f.seed}" if f.seed is not None else ""
            lines.append(f"{kind} in {self.op} ({self.impl}){where}{seed}")
            lines += f.lines()
        if any(r["gate_metric"] not in QUIET_METRICS for f in self.failures for r in f.rows):
            lines.append("  (what each bound means and why it is set there: mla-verify list --tolerances --long)")
        if len(self.failures) > 1 and (groups := of_frame(self.rows)):  # one bug found several ways reads as one
            lines.append(f"FAIL: {len(self.failures)} findings, by cause:")
            lines += cause_lines(groups)
        if self.interrupted:
            lines.append(f"INTERRUPTED after {self.examples} examples (seed {self.seed}); rows so far in {self.out}"
                         if self.out else f"INTERRUPTED after {self.examples} examples (seed {self.seed})")
        elif self.no_verdict:
            lines.append(f"NO VERDICT: {self.no_verdict}")
        elif self.passed:
            seeds = (f"seed {self.seed}" if self.campaigns == 1
                     else f"seeds {self.seed}..{self.seed + self.campaigns - 1}")
            over = f" over {self.campaigns} campaigns" if self.campaigns > 1 else ""
            judged = f" ({IN_PROCESS})" if self.in_process else ""
            fence = f"; {self.sandbox}" if self.sandbox else ""
            reach = f"; reached {where}" if (where := reached(self.rows)) else ""
            drawn = "" if self.covering else " drawn, the covering set skipped (--no-covering-set)"
            lines.append(f"PASS{judged}: {self.examples} examples{drawn}{over}, no discrepancy ({seeds})"
                         f"{_headroom(self.rows)}"
                         f"{reach}{fence}")
        if self.unsupported:
            first = self.rows[self.rows.gate_metric == FailureKind.UNSUPPORTED].reason.iloc[0]
            lines.append(f"  {self.unsupported} of them declined by the implementation (mla_verify.unsupported), "
                         f"not checked: {first.removeprefix('unsupported: ')}")
        lines += not_judged_lines(self.rows)
        if len(self.rows):
            lines += bias_of(self.rows).lines()
        return lines

    @property
    def unsupported(self) -> int:
        """Cases the implementation declined (`mla_verify.unsupported`): counted, not failed."""
        if not len(self.rows):
            return 0
        return self.rows[self.rows.gate_metric == FailureKind.UNSUPPORTED].case_id.nunique()

    @property
    def exit_code(self) -> int:
        """What the CLI returns: 130 interrupted, 1 a failure, 4 nothing judged, 0 a pass."""
        return 130 if self.interrupted else 4 if self.no_verdict else 0 if self.passed else 1


# A case whose rows are only these was not judged: a run or gate unit of nothing else is NO VERDICT.
UNJUDGED = (FailureKind.UNSUPPORTED, FailureKind.NOT_JUDGED)


def not_judged_lines(rows) -> list[str]:
    """The line saying how many cases the judge could not fit on the device (`FailureKind.NOT_JUDGED`):
    counted, never failed, never silent. `rows`: a frame or a list of Row."""
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame([(r.case_id, r.gate_metric, r.reason) for r in rows],
                                                                    columns=["case_id", "gate_metric", "reason"])
    mine = frame[frame.gate_metric == FailureKind.NOT_JUDGED] if len(frame) else frame
    if not len(mine):
        return []
    return [f"  {mine.case_id.nunique()} cases not judged, {mine.reason.iloc[0].removeprefix('not judged: ')}"]


def _headroom(rows: pd.DataFrame) -> str:
    gated = rows[(rows.gate_metric != "") & (rows.gate_metric != FailureKind.UNSUPPORTED) & rows.passed] if len(rows) else rows
    if not len(gated):
        return ""
    r = gated.loc[gated.headroom.idxmin()]
    return f"; least headroom: {r.tensor} {r.gate_metric} = {r.value:.3g} of {r.bound:.3g}"


def result_file(result: CheckResult) -> str:
    """A campaign's outcome as JSON (what a parallel part leaves for its parent)."""
    return json.dumps({"examples": result.examples, "seed": result.seed, "passed": result.passed,
                       "interrupted": result.interrupted, "notes": result.notes, "sandbox": result.sandbox,
                       "failures": [f.to_dict() for f in result.failures]}, indent=2) + "\n"


@dataclass
class GateOutcome:
    """What a gate run leaves: its rows and verdict, and what the CLI prints of it."""

    rows: list
    failed: bool
    out: Path
    interrupted: bool = False
    notes: list[str] = field(default_factory=list)
    odd_ones_out: list[str] = field(default_factory=list)
    case_files: list[tuple[Path, list[str]]] = field(default_factory=list)  # each saved case, its lines (replay first)
    parts: int = 1
    isolated: bool = True           # judged out of the kernels' reach (reports.meta.IN_PROCESS otherwise)
    sandbox: str = ""               # what its workers stood behind (sandbox.boundary), as its last line says
    rest: tuple[int, str] = (0, "")  # interrupted: the ops not finished, and the command that runs them
    never_called: str = ""          # the replaced stages no case called (runs.driver): nothing judged what was asked

    def lines(self) -> list[str]:
        """Notes, disagreeing implementations, the findings' case files (a run in parts: its parts said them),
        the units that judged nothing and the replaced stages never called; interrupted, the command that
        runs what it did not reach."""
        left, command = self.rest
        return ([f"note: {n}" for n in self.notes] + [f"odd one out: {line}" for line in self.odd_ones_out]
                + [text for f, rows in self.case_files
                   for text in [f"finding saved: {f}", *rows]]
                + [line.strip() for line in not_judged_lines(self.rows)]
                + [f"NO VERDICT: {unit}: every case declined by the implementation (mla_verify.unsupported) or not "
                   "judged" for unit in self.unjudged]
                + ([f"INTERRUPTED: {len(self.rows)} rows written to {self.out}"] if self.interrupted else [])
                + ([f"  the rest ({left} op{'s' * (left != 1)} not finished, the cases this run would have drawn "
                    f"for them): {command}"] if self.interrupted and command else [])
                + ([f"NO VERDICT: {self.never_called}"] if self.never_called and not self.failed else []))

    @property
    def unjudged(self) -> list[str]:
        """The units ("op impl") that judged nothing: every case of theirs declined."""
        units: dict[str, bool] = {}
        for r in self.rows:
            unit = f"{r.op} {r.impl}"
            units[unit] = units.get(unit, True) and r.gate_metric in UNJUDGED
        return [unit for unit, nothing in units.items() if nothing]

    @property
    def no_verdict(self) -> bool:
        """Whether something asked was never judged (a unit of declined cases, a replaced stage never
        called): exit 4 where nothing failed."""
        return bool(self.unjudged or self.never_called)

    @property
    def exit_code(self) -> int:
        return 130 if self.interrupted else 1 if self.failed else 4 if self.no_verdict else 0


def rest_command(run: Any, ops: Sequence[str], out: Path) -> str:
    """The gate command that runs `ops` (an interrupted gate's ops and properties not finished) with
    `run`'s settings (a `runs.plan.Run`) and seed: the cases the whole run would have drawn for them,
    the kept corpus's first, into `out`."""
    argv = ["mla-verify", "gate", "--device", run.device_type, "--profile", run.profile.name, "--seed", str(run.seed)]
    argv += ["--examples", str(run.examples)] if run.examples is not None else []
    argv += [a for spec in run.impls for a in ("--impl", spec)]
    argv += ["--corpus", run.corpus] if run.corpus else []
    argv += [] if run.isolate else ["--no-isolate"]
    argv += ["--timeout", f"{run.timeout:g}"] if run.timeout != DEFAULT_TIMEOUT_S else []
    return shlex.join([*argv, *(a for op in ops for a in ("--op", op)), "--out", str(out)])


def replay_command(case_file: Path | None, specs: Sequence[str], device: str, deviations: Sequence[str] = (),
                   timeout: float | None = None, isolate: bool = False, conventions: Sequence[str] = ()) -> str:
    """The command that reproduces a saved failure (isolated where the failure was: a hang or a
    crash replayed in-process would hang or kill the replay)."""
    argv = ["mla-verify", "replay", str(case_file) if case_file else "CASE_FILE"]
    for s in specs:
        argv += ["--impl", "MODULE:CALLABLE" if is_local(s) else s]
    for d in deviations:
        argv += ["--deviation", d]
    for c in conventions:
        argv += ["--convention", c]
    argv += ["--device", device_type(device)]
    if isolate and not is_cuda(device):  # isolated by default on cuda
        argv.append("--isolate")
    if timeout is not None and timeout != DEFAULT_TIMEOUT_S:
        argv += ["--timeout", f"{timeout:g}"]
    return shlex.join(argv)
