"""Gate and fuzz campaigns over several GPUs: one child process per GPU, rows merged into one run.

Gate: the ops (and properties) are dealt round-robin to N children; child i sees only GPU i
(`CUDA_VISIBLE_DEVICES`), except the child that runs `dcp`, which keeps every GPU so its ranks can
spread over them (nccl, one GPU per rank). Fuzz: N independent campaigns of one op, each with its
own seed (the parent's seed + i) and its share of the examples. Each child writes its rows to
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


def deal(ops: list[str], parts: int) -> list[list[str]]:
    """Round-robin, the specs of many ranks first into part 0 (the one that keeps every GPU)."""
    from mla_verify.equivalence.catalog import get_spec

    ordered = sorted(ops, key=lambda op: not get_spec(op).ranks)
    return [ordered[i::parts] for i in range(parts) if ordered[i::parts]]


def share(examples: int, parts: int) -> list[int]:
    """`examples` split over at most `parts` campaigns, none empty, the first ones one larger."""
    parts = max(1, min(parts, examples))
    return [examples // parts + (i < examples % parts) for i in range(parts)]


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


def _collect(procs: list[subprocess.Popen], out: Path) -> tuple[pd.DataFrame, list[int]]:
    """Wait for every child; their rows together, and each one's exit code (1 for a child that
    exited 0 without leaving rows)."""
    from mla_verify import reports

    codes = [p.wait() for p in procs]
    frames = []
    for i, code in enumerate(codes):
        try:  # a part killed early may have left its journal only, or nothing
            frames.append(reports.load_run(out / f"part-{i}")[0])
        except (OSError, ValueError):
            codes[i] = code or 1
    return (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()), codes


def run_parts(ops: list[str], parts: int, device: str, out: Path, child_args: list[str]) -> tuple[pd.DataFrame, int]:
    """Run the child gates, wait for all, and return their rows together and the worst exit code."""
    from mla_verify.equivalence.catalog import get_spec

    procs = [_child("gate", i, [*child_args, *(a for op in part_ops for a in ("--op", op))], device, out,
                    pin=not any(get_spec(op).ranks for op in part_ops))
             for i, part_ops in enumerate(deal(ops, parts))]
    frame, codes = _collect(procs, out)
    return frame, max(codes)


def fuzz_parts(child_args: list[str], examples: int, seed: int, parts: int, device: str,
               out: Path) -> tuple[pd.DataFrame, list[tuple[int, int, Path]]]:
    """Run one fuzz campaign per part (output in OUT/part-i/fuzz.log); the rows together, and
    (seed, exit code, log) per part."""
    shares = share(examples, parts)
    logs = [out / f"part-{i}" / "fuzz.log" for i in range(len(shares))]
    procs = [_child("fuzz", i, [*child_args, "--examples", str(n), "--seed", str(seed + i)], device, out,
                    pin=True, log=logs[i])
             for i, n in enumerate(shares)]
    frame, codes = _collect(procs, out)
    return frame, [(seed + i, code, log) for i, (code, log) in enumerate(zip(codes, logs))]


RESULT_JSON = "result.json"  # a fuzz part's outcome (mla_verify.results.result_file)


def check_in_parts(plan, parts: int, log):
    """`mla_verify.check` as `parts` child campaigns (seeds S, S+1, ...) sharing the examples;
    their rows merged into the run directory, each part's failure read from its result.json."""
    from .interrupt import Interrupt
    from .results import CheckResult, Failure

    device = plan.device.split(":")[0]
    child = ["--op", plan.op, "--profile", plan.profile.name,
             *(["--timeout", f"{plan.timeout:g}"] if plan.isolate else []),  # kept only where a call can be stopped
             *(a for spec in plan.specs for a in ("--impl", spec)),
             *(a for name in plan.deviations for a in ("--deviation", name)),
             *(a for c in plan.conventions for a in ("--convention", c)),
             *(["--path", plan.path] if plan.path else []), *([] if plan.shrink else ["--no-shrink"]),
             "--isolate" if plan.isolate else "--no-isolate"]
    out = plan.run_dir.path if plan.run_dir else Path(tempfile.mkdtemp(prefix="mla-verify-parts-"))
    shares = share(plan.examples, parts)
    if log is not None:
        log(f"  {len(shares)} campaigns, one per {'GPU' if device == 'cuda' else 'process'}: "
            + ", ".join(f"seed {plan.seed + i} x {n}" for i, n in enumerate(shares)) + f"; logs {out}/part-*/fuzz.log")
    meta = plan.meta()
    if plan.run_dir:
        plan.run_dir.start({**meta, "seeds": [plan.seed + i for i in range(len(shares))]})
    with Interrupt().installed():  # Ctrl-C reaches every part: each finishes its case and writes its run
        frame, results = fuzz_parts(child, plan.examples, plan.seed, parts, device, out)
    if plan.run_dir:
        plan.run_dir.finish(frame, {**meta, "seeds": [plan.seed + i for i in range(len(shares))]})
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
    return CheckResult(plan.op, plan.label, passed, rows, plan.seed, examples,
                       plan.run_dir.path if plan.run_dir else None, failures, interrupted=interrupted, notes=notes,
                       campaigns=len(results), in_process=plan.in_process)
