"""Gate and fuzz campaigns over several GPUs: one child process per GPU, rows merged into one run.

Gate: the ops (and properties) are dealt round-robin to N children; child i sees only GPU i
(`CUDA_VISIBLE_DEVICES`), except the child that runs `dcp`, which keeps every GPU so its ranks can
spread over them (nccl, one GPU per rank). Fuzz: N independent campaigns of one op, each with its
own seed (the parent's seed + i) and its share of the examples. Each child writes its rows to
`OUT/part-i`; the parent concatenates them into `OUT` and reports once. On CPU the same split runs
N CPU processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd


def deal(ops: list[str], parts: int) -> list[list[str]]:
    """Round-robin, `dcp` first into part 0 (the one that keeps every GPU)."""
    ordered = sorted(ops, key=lambda op: op != "dcp")
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
    exited 0 without writing its run)."""
    from mla_verify import reports

    codes = [p.wait() for p in procs]
    frames = []
    for i, code in enumerate(codes):
        part = out / f"part-{i}"
        if (part / "meta.json").exists():
            frames.append(reports.load_run(part)[0])
        elif code == 0:
            codes[i] = 1
    return (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()), codes


def run_parts(ops: list[str], parts: int, device: str, out: Path, child_args: list[str]) -> tuple[pd.DataFrame, int]:
    """Run the child gates, wait for all, and return their rows together and the worst exit code."""
    procs = [_child("gate", i, [*child_args, *(a for op in part_ops for a in ("--op", op))], device, out,
                    pin="dcp" not in part_ops)
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
