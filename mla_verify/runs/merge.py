"""`merge`: the run directories of a run's shards (`--shard I/N`, `runs.parts`) joined into the one
run a single machine would have written: its rows, its meta (every shard's seeds), every shard's
saved failing cases, every shard's unit seconds (durations.json: `gate --durations` sizes the next
run's shards by them). `mla-verify report` then reads it like any run.

Shards that do not belong together are refused, each reason named: another revision of the
code, other options (op, implementations, examples, seed, profile, device, ...), other shard
counts, a shard given twice, a shard that did not finish, a harness error; and the shards that
are missing are named. `force=True` merges what it is given anyway; the reasons stay in
`Merged.problems` (and `merge` exits 1 where shards are missing: cases that never ran are not
a pass).
"""

from __future__ import annotations

import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from mla_verify.equivalence.errors import UsageError
from mla_verify.fuzz import casefile
from mla_verify.reports.store import conform

from . import durations
from .corpus import name
from .parts import Shard
from .rundir import RunDir, load_run

HARNESS_ERROR = "harness-error.txt"


@dataclass
class Merged:
    out: Path
    rows: pd.DataFrame
    shards: list[Shard]
    missing: list[Shard] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # merged anyway (force)
    harness_errors: list[Path] = field(default_factory=list)

    def lines(self) -> list[str]:
        count = self.shards[0].count if self.shards else 0
        out = [f"merged {len(self.shards)} of {count} shards: {len(self.rows)} rows into {self.out}"]
        out += [f"note: {p} (merged anyway: --force)" for p in self.problems]
        if self.missing:
            out.append(f"MISSING shard(s) {', '.join(map(str, self.missing))}: their cases did not run")
        out += [f"note: a shard's harness error, copied to {p}" for p in self.harness_errors]
        return out


def shard_of(meta: dict[str, Any]) -> Shard:
    """The shard a run recorded (an unsharded run: 0/1)."""
    return Shard.parse((meta.get("extra") or {}).get("shard"))


def _options(meta: dict[str, Any]) -> dict[str, Any]:
    return dict((meta.get("extra") or {}).get("run") or {})


def _problems(runs: list[tuple[Path, Shard, dict]]) -> tuple[list[str], list[Shard]]:
    """Why the runs are not the shards of one run, and the shards missing."""
    problems = []
    (first, _, meta0), rest = runs[0], runs[1:]
    revision = (meta0.get("git") or {}).get("revision")
    for path, _, meta in rest:
        other = (meta.get("git") or {}).get("revision")
        if other != revision:
            problems.append(f"{path} ran revision {other}, {first} revision {revision}")
        a, b = _options(meta0), _options(meta)
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        if differ:
            problems.append(f"{path} ran other options than {first}: "
                            + ", ".join(f"{k} {b.get(k)!r} vs {a.get(k)!r}" for k in differ))
    counts = sorted({s.count for _, s, _ in runs})
    if len(counts) > 1:
        problems.append(f"shards of different counts: {', '.join(f'of {c}' for c in counts)}")
    given = defaultdict(list)
    for path, shard, _ in runs:
        given[shard].append(path)
    problems += [f"shard {s} given {len(paths)} times: {', '.join(map(str, paths))}"
                 for s, paths in sorted(given.items()) if len(paths) > 1]
    problems += [f"{path} did not finish (its rows come from its journal)" for path, _, meta in runs
                 if meta.get("incomplete") and not meta.get("stopped")]
    problems += [f"{path} stopped early ({meta['stopped']}): its cases not reached have no verdict"
                 for path, _, meta in runs if meta.get("stopped")]
    missing = [Shard(i, counts[-1]) for i in range(counts[-1]) if Shard(i, counts[-1]) not in given]
    return problems, missing


def _meta(runs: list[tuple[Path, Shard, dict]]) -> dict[str, Any]:
    """The first shard's meta as the whole run's: every shard's seeds and examples, from the first
    start (the merge stamps the end)."""
    meta = dict(runs[0][2])
    extra = {k: v for k, v in (meta.get("extra") or {}).items() if k not in ("shard", "run")}
    if "examples" in extra and extra.get("op") is not None:  # fuzz: each shard recorded its own cases
        extra["examples"] = sum((m.get("extra") or {}).get("examples") or 0 for _, _, m in runs)
    extra["merged"] = [f"{shard} {path}" for path, shard, _ in runs]
    starts = [m["started_at"] for _, _, m in runs if m.get("started_at")]
    meta.update(seeds=sorted({int(s) for _, _, m in runs for s in m.get("seeds") or []}), extra=extra,
                started_at=min(starts) if starts else None)
    meta.pop("incomplete", None)
    return meta


def _copy_findings(source: Path, out: Path) -> list[Path]:
    """Every finding a shard saved (its own and its parts') under out/failures, once: a file of the
    same name holding the same finding (two campaigns shrank to one case: `corpus.name`) is that
    finding, as the rows that name it count it; the harness errors it left, as harness-error files
    named for it."""
    errors = []
    for case in sorted(source.glob("failures/*.json")) + sorted(source.glob("part-*/failures/*.json")):
        (out / "failures").mkdir(exist_ok=True)
        target, n = out / "failures" / case.name, 1
        while target.exists() and name(casefile.load(target)) != name(casefile.load(case)):
            n += 1
            target = target.with_name(f"{case.stem}-{n}{case.suffix}")
        if not target.exists():
            shutil.copy2(case, target)
    for n, error in enumerate(sorted(source.glob(HARNESS_ERROR)) + sorted(source.glob(f"part-*/{HARNESS_ERROR}"))):
        target = out / f"harness-error-{source.name}{f'-{n}' if n else ''}.txt"
        shutil.copy2(error, target)
        errors.append(target)
    return errors


def merge(runs: Sequence[str | Path], out: str | Path, *, force: bool = False) -> Merged:
    """Join the shards' run directories `runs` into the run directory `out` (which must not hold a
    run). Raises UsageError, before writing anything, for an unreadable run or, unless `force`,
    for runs that are not the shards of one run or shards missing (each reason named)."""
    if not runs:
        raise UsageError("merge: name the shards' run directories")
    loaded = []
    for path in map(Path, runs):
        rows, meta = load_run(path, "shard")
        try:
            shard = shard_of(meta)
        except ValueError as exc:
            raise UsageError(f"{path}: {exc}") from None
        loaded.append((path, shard, meta, rows))
    runs_meta = [(p, s, m) for p, s, m, _ in loaded]
    problems, missing = _problems(runs_meta)
    if (problems or missing) and not force:
        reasons = problems + ([f"missing shard(s) {', '.join(map(str, missing))}"] if missing else [])
        raise UsageError("merge refused: " + "; ".join(reasons) + " (--force merges them anyway)")
    rows = conform(pd.concat([r for *_, r in loaded], ignore_index=True))
    run_dir = RunDir.open(out)
    errors = []
    try:
        for path, *_ in loaded:
            errors += _copy_findings(path, run_dir.path)
        durations.write(run_dir.path, durations.joined(path for path, *_ in loaded))   # the next run's shards
        meta = _meta(runs_meta)
    except BaseException:
        run_dir.release()
        raise
    run_dir.finish(rows, meta)
    return Merged(run_dir.path, rows, sorted(s for _, s, _ in runs_meta), missing, problems, errors)
