"""Slots and child processes: one run split into disjoint, deterministic shares (`Shard`), and a
run in parts, one child process per part of this host, their rows merged into one run.

Shards let N machines (a CI matrix, a Slurm array, an Indexed Job) together run exactly what one
machine would have. A run of N shards with P parts each (`--shard I/N --parallel P`) is T = N * P
slots. Parts are the shards of one host: part j of shard I is slot I * P + j of T, so
`--parallel P` on one machine and P machines of `--shard I/P` deal the same slots.

    fuzz   slot k is the campaign of seed S + k with `share(E, T)[k]` of the E examples
           (nothing when E < T leaves it none); one slot is the unsharded run itself
    gate   slot k runs every T-th of the gate's units, one unit being an op (or property) and
           an implementation with its corpus and campaigns, the multi-rank ones dealt first
           (the part of a host that holds them keeps every GPU for their ranks); every unit
           fuzzes with the run's seed S

The index comes from the caller (`--shard I/N`), or from the scheduler's own variables (`--shard
auto`, `runs.schedulers`). The gate's units go by count (every T-th), or, given each unit's seconds
last time (`runs.durations`), longest first to the slot with the fewest seconds so far.

Each child runs the `Run` of its slot (`python -m mla_verify.runs.driver RUN_JSON`, `Run.part`).
Child i sees only GPU i mod the GPU count (`CUDA_VISIBLE_DEVICES`): more parts than GPUs share
them. A gate's child that runs `dcp` keeps every GPU so its ranks can spread over them (nccl, one
GPU per rank). Each child runs with its share of the host's cores as torch threads. Fuzz: each
child runs its slot's campaign, its own seed and share of the examples. Each child writes its rows
to `OUT/part-i` (a fuzz part also its outcome, `result.json`: its failure, case file and replay
command, and its output to `fuzz.log`); the parent concatenates the rows into `OUT` and reports
once. On CPU the same split runs N CPU processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence, TypeVar

import pandas as pd
import torch

from mla_verify.equivalence.sandbox.device import GPU_SHARE_ENV
from mla_verify.equivalence.judge.rows import Row
from mla_verify.reports.store import conform, load_run, rows_frame

from . import durations
from .interrupt import Interrupt
from .outcome import RESULT_JSON, CheckResult, Failure, GateOutcome
from .schedulers import from_environment

T = TypeVar("T")


@dataclass(frozen=True, order=True)
class Shard:
    """Shard `index` of `count` (0-based): "I/N" on the command line, or "auto"."""

    index: int = 0
    count: int = 1
    source: str = field(default="", compare=False)   # where "auto" read it: "SLURM_ARRAY_TASK_ID=3 of ..."

    def __post_init__(self) -> None:
        if not (isinstance(self.index, int) and isinstance(self.count, int) and 0 <= self.index < self.count):
            raise ValueError(f"shard {self.index}/{self.count}: expected I/N with 0 <= I < N")

    @classmethod
    def parse(cls, text: "str | Shard | None") -> "Shard":
        """"I/N", "auto" (the scheduler's variables, `runs.schedulers`), a Shard, or None (the whole
        run, 0/1); ValueError saying what is wrong."""
        if text is None:
            return cls()
        if isinstance(text, Shard):
            return text
        if str(text).strip() == "auto":
            return cls(*from_environment(os.environ))
        index, sep, count = str(text).partition("/")
        if not sep or not index.strip().isdigit() or not count.strip().isdigit():
            raise ValueError(f"shard {text!r}: expected I/N, e.g. 0/4 (I from 0 to N-1), or auto")
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

    def deal(self, units: Sequence[T], first: Sequence[bool] = (), weights: Sequence[float] | None = None) -> list[T]:
        """This slot's units, in their own order, those flagged in `first` dealt before the rest. By
        count: every count-th of them. By `weights` (each unit's seconds last time, `runs.durations`):
        longest first, each to the slot with the fewest seconds so far (the lowest on a tie), so the
        slots end about together; equal weights deal as by count."""
        flagged = [bool(f) for f in first] + [False] * (len(units) - len(first))
        if weights is None:
            order = sorted(range(len(units)), key=lambda i: not flagged[i])
            mine = set(order[self.index::self.count])
        else:
            loads, mine = [0.0] * self.count, set()
            for i in sorted(range(len(units)), key=lambda i: (not flagged[i], -weights[i])):
                slot = loads.index(min(loads))
                loads[slot] += weights[i]
                if slot == self.index:
                    mine.add(i)
        return [u for i, u in enumerate(units) if i in mine]


def share(examples: int, parts: int) -> list[int]:
    """`examples` split over at most `parts` campaigns, none empty, the first ones one larger."""
    parts = max(1, min(parts, examples))
    return [examples // parts + (i < examples % parts) for i in range(parts)]


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them to a child."""
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count()
    return named.split(",")[:count] if named else [str(i) for i in range(count)]


def child_env(run, part: int, parts: int, pin: bool) -> dict[str, str]:
    """A part's environment: on CUDA, pinned to one GPU, dealt round-robin (more parts than GPUs
    share them: a campaign keeps its GPU busy a fraction of the time, measured in docs/measured.md),
    each held to its share of the GPU's memory (MLA_VERIFY_GPU_SHARE); its share of this host's
    cores as torch threads (OMP_NUM_THREADS, unless the user set it): parts with every core each
    ran several times slower than with their share."""
    env = dict(os.environ)
    if run.device_type == "cuda" and pin:
        gpus = visible_gpus() or [str(part)]
        env["CUDA_VISIBLE_DEVICES"] = gpus[part % len(gpus)]
        sharing = len(range(part % len(gpus), parts, len(gpus)))  # the parts dealt this GPU
        if sharing > 1:
            env[GPU_SHARE_ENV] = f"{1 / sharing:.6f}"
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // parts))
    return env


def _placed(run, parts: int) -> str:
    """Where `parts` processes run: "one per process", "one per GPU", "4 on 1 GPU"."""
    if run.device_type != "cuda":
        return "one per process"
    gpus = len(visible_gpus())
    return "one per GPU" if parts <= gpus else f"{parts} on {gpus} GPU{'s' if gpus != 1 else ''}"


def _child(run, part: int, parts: int, pin: bool, log: Path | None = None) -> subprocess.Popen:
    env = child_env(run, part, parts, pin)
    argv = [sys.executable, "-m", "mla_verify.runs.driver", run.to_json()]
    if log is None:
        return subprocess.Popen(argv, env=env)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        return subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT)


def _collect(procs: dict[int, subprocess.Popen], out: Path) -> tuple[pd.DataFrame, dict[int, int]]:
    """Wait for every child (by part number); their rows together, and each one's exit code (1 for
    a child that exited 0 without leaving rows)."""
    codes = {i: p.wait() for i, p in procs.items()}
    frames = []
    for i, code in codes.items():
        try:  # a part killed early may have left its journal only, or nothing
            frames.append(load_run(out / f"part-{i}")[0])
        except (OSError, ValueError):
            codes[i] = code or 1
    return (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()), codes


def _root(run) -> Path:
    return run.out.path if run.out else Path(tempfile.mkdtemp(prefix="mla-verify-parts-"))


def gate_in_parts(run, every: list, log) -> GateOutcome:
    """The gate as one child per slot that holds some of its units `every` (`runs.units`); their
    rows into the run directory."""
    log = log or (lambda line: None)
    weights = durations.weights([u.key for u in every], run.durations)
    dealt = {i: slot.deal(every, [u.multi_rank for u in every], weights) for i, slot in enumerate(run.slots)}
    log(f"  {len(run.slots)} parts, {_placed(run, len(run.slots))}")
    meta, root = run.meta(), _root(run)
    run.out.start(meta)
    with Interrupt().installed():  # Ctrl-C reaches every part: each finishes its case and writes its run
        busy = {i: mine for i, mine in dealt.items() if mine}
        procs = {i: _child(run.part(run.slots[i], i, root), i, len(busy), pin=not any(u.multi_rank for u in mine))
                 for i, mine in busy.items()}
        frame, codes = _collect(procs, root)
    durations.write(root, durations.joined(root / f"part-{i}" for i in procs))
    run.out.finish(frame, meta)
    rows = [Row.from_record(r) for r in frame.to_dict("records")]
    return GateOutcome(rows, max(codes.values()) != 0 or any(not r.passed for r in rows), root, parts=len(procs),
                       isolated=run.isolate)


def check_in_parts(run, log):
    """`mla_verify.check` as one child campaign per part (seeds S + k, each its share of the
    examples); their rows merged into the run directory, each part's failure read from its
    result.json."""
    campaigns, root = run.campaigns, _root(run)
    if log is not None:
        log(f"  {len(campaigns)} campaigns, {_placed(run, len(campaigns))}: "
            + ", ".join(f"seed {seed} x {n}" for seed, n in campaigns) + f"; logs {root}/part-*/fuzz.log")
    meta = run.meta()
    if run.out:
        run.out.start(meta)
    logs = [root / f"part-{i}" / "fuzz.log" for i in range(len(campaigns))]
    with Interrupt().installed():  # Ctrl-C reaches every part: each finishes its case and writes its run
        procs = {i: _child(run.part(slot, i, root), i, len(campaigns), pin=True, log=logs[i])
                 for i, slot in enumerate(s for s in run.slots if s.campaign(run.seed, run.examples)[1])}
        frame, codes = _collect(procs, root)
    if run.out:
        run.out.finish(frame, meta)
    failures, notes, examples, interrupted, clean, sandbox = [], [], 0, False, True, ""
    for i, (seed, _) in enumerate(campaigns):
        path, code = root / f"part-{i}" / RESULT_JSON, codes[i]
        if not path.exists():
            notes.append(f"part {i} (seed {seed}) exited with code {code} and left no result; its log: {logs[i]}")
            clean = False
            continue
        part = json.loads(path.read_text())
        examples += part["examples"]
        interrupted |= part["interrupted"]
        sandbox = sandbox or part.get("sandbox", "")
        clean &= code in (0, 1, 4, 130) and (part["passed"] or bool(part["failures"]) or code == 4)
        failures += [Failure.from_dict(f) for f in part["failures"]]
        notes.append(f"part {i} (seed {seed}): exit {code}, {part['examples']} examples"
                     + "".join(f"; {n}" for n in part["notes"]))
    passed = clean and not failures and not interrupted and bool(frame.passed.all() if len(frame) else True)
    rows = conform(frame) if len(frame) else rows_frame([])
    return CheckResult(run.op, run.label, passed, rows, campaigns[0][0], examples, run.out.path if run.out else None,
                       failures, interrupted=interrupted, notes=notes, campaigns=len(campaigns),
                       in_process=run.in_process, sandbox=sandbox, covering=run.covering)
