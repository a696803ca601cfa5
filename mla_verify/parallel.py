"""Gate and fuzz campaigns over several GPUs: one child process per GPU, rows merged into one run.

The parts of a run are the shards of one host (`fuzz.shard`): part j of shard I of N, with P
parts, is slot I * P + j of N * P. Gate: each child runs its slot's units; child i sees only GPU
i (`CUDA_VISIBLE_DEVICES`), except the child that runs `dcp`, which keeps every GPU so its ranks
can spread over them (nccl, one GPU per rank). Fuzz: each child runs its slot's campaign, its
own seed and share of the examples. Each child writes its rows to
`OUT/part-i` (a fuzz part also its outcome, `result.json`: its failure, case file and replay
command); the parent concatenates the rows into `OUT` and reports once. On CPU the same split runs
N CPU processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from mla_verify.fuzz.shard import share  # noqa: F401 - the examples' split, here since --parallel had it


def _child(command: str, part: int, args: list[str], device: str, out: Path, pin: bool,
           log: Path | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    if device == "cuda" and pin:
        env["CUDA_VISIBLE_DEVICES"] = str(part)
    argv = [sys.executable, "-m", "mla_verify.cli", command, "--device", device, "--part",
            "--out", str(out / f"part-{part}"), *args]
    if log is None:
        return subprocess.Popen(argv, env=env)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        return subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT)


def _collect(procs: dict[int, subprocess.Popen], out: Path) -> tuple[pd.DataFrame, dict[int, int]]:
    """Wait for every child (by part number); their rows together, and each one's exit code (1 for
    a child that exited 0 without leaving rows)."""
    from mla_verify import reports

    codes = {i: p.wait() for i, p in procs.items()}
    frames = []
    for i, code in codes.items():
        try:  # a part killed early may have left its journal only, or nothing
            frames.append(reports.load_run(out / f"part-{i}")[0])
        except (OSError, ValueError):
            codes[i] = code or 1
    return (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()), codes


def run_parts(ops: list[str] | None, slots: list, device: str, out: Path,
              child_args: list[str]) -> tuple[pd.DataFrame, int]:
    """Run one child gate per slot (`fuzz.shard.Shard`) that holds units, wait for all, and return
    their rows together and the worst exit code."""
    from mla_verify.fuzz.gate import units

    every = units(ops, device)
    dealt = {i: slot.deal(every, [u.multi_rank for u in every]) for i, slot in enumerate(slots)}
    procs = {i: _child("gate", i, [*child_args, "--shard", str(slots[i]), *(a for op in ops or [] for a in ("--op", op))],
                       device, out, pin=not any(u.multi_rank for u in mine))
             for i, mine in dealt.items() if mine}
    frame, codes = _collect(procs, out)
    return frame, max(codes.values())


def fuzz_parts(child_args: list[str], campaigns: list[tuple[int, int]], device: str,
               out: Path) -> tuple[pd.DataFrame, list[tuple[int, int, Path]]]:
    """Run one fuzz campaign (seed, examples) per part (output in OUT/part-i/fuzz.log); the rows
    together, and (seed, exit code, log) per part."""
    logs = [out / f"part-{i}" / "fuzz.log" for i in range(len(campaigns))]
    procs = {i: _child("fuzz", i, [*child_args, "--examples", str(n), "--seed", str(seed)], device, out,
                       pin=True, log=logs[i])
             for i, (seed, n) in enumerate(campaigns)}
    frame, codes = _collect(procs, out)
    return frame, [(seed, codes[i], logs[i]) for i, (seed, _) in enumerate(campaigns)]


RESULT_JSON = "result.json"  # a fuzz part's outcome (mla_verify.results.result_file)


def check_in_parts(plan, log):
    """`mla_verify.check` as `parts` child campaigns (seeds S, S+1, ...) sharing the examples;
    their rows merged into the run directory, each part's failure read from its result.json."""
    from .interrupt import Interrupt
    from .results import CheckResult, Failure

    device = plan.device.split(":")[0]
    child = ["--op", plan.op, "--profile", plan.profile.name, "--timeout", f"{plan.timeout:g}",
             *(a for spec in plan.specs for a in ("--impl", spec)),
             *(a for name in plan.deviations for a in ("--deviation", name)),
             *(["--path", plan.path] if plan.path else []), *([] if plan.shrink else ["--no-shrink"]),
             "--isolate" if plan.isolate else "--no-isolate"]
    out = plan.run_dir.path if plan.run_dir else Path(tempfile.mkdtemp(prefix="mla-verify-parts-"))
    if log is not None:
        log(f"  {len(plan.campaigns)} campaigns, one per {'GPU' if device == 'cuda' else 'process'}: "
            + ", ".join(f"seed {seed} x {n}" for seed, n in plan.campaigns) + f"; logs {out}/part-*/fuzz.log")
    meta = plan.meta()
    if plan.run_dir:
        plan.run_dir.start(meta)
    with Interrupt().installed():  # Ctrl-C reaches every part: each finishes its case and writes its run
        frame, results = fuzz_parts(child, plan.campaigns, device, out)
    if plan.run_dir:
        plan.run_dir.finish(frame, meta)
    failures, notes, examples, interrupted, clean = [], [], 0, False, True
    for i, (seed, code, _log) in enumerate(results):
        path = out / f"part-{i}" / RESULT_JSON
        if not path.exists():
            notes.append(f"part {i} (seed {seed}) exited with code {code} and left no result; its log: {_log}")
            clean = False
            continue
        part = json.loads(path.read_text())
        examples += part["examples"]
        interrupted |= part["interrupted"]
        clean &= code in (0, 1, 130) and (part["passed"] or bool(part["failures"]))
        failures += [Failure.from_dict(f) for f in part["failures"]]
        notes.append(f"part {i} (seed {seed}): exit {code}, {part['examples']} examples"
                     + "".join(f"; {n}" for n in part["notes"]))
    passed = clean and not failures and not interrupted and bool(frame.passed.all() if len(frame) else True)
    from mla_verify.reports.store import conform, rows_frame

    rows = conform(frame) if len(frame) else rows_frame([])
    return CheckResult(plan.op, plan.label, passed, rows, plan.campaigns[0][0], examples,
                       plan.run_dir.path if plan.run_dir else None, failures, interrupted=interrupted, notes=notes,
                       campaigns=len(results))
