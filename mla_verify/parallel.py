"""The gate over several GPUs: one child gate process per GPU, its rows merged into one run.

The ops (and properties) are dealt round-robin to N children; child i sees only GPU i
(`CUDA_VISIBLE_DEVICES`), except the child that runs `dcp`, which keeps every GPU so its ranks can
spread over them (nccl, one GPU per rank). Each child writes its rows to `OUT/part-i`; the parent
concatenates them into `OUT` and reports once. On CPU the same split runs N CPU processes.
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


def run_parts(ops: list[str], parts: int, device: str, out: Path, child_args: list[str]) -> tuple[pd.DataFrame, int]:
    """Run the child gates, wait for all, and return their rows together and the worst exit code."""
    import reports

    procs = []
    for i, part_ops in enumerate(deal(ops, parts)):
        env = dict(os.environ)
        if device == "cuda" and "dcp" not in part_ops:
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        argv = [sys.executable, "-m", "mla_verify.cli", "gate", "--device", device, "--part",
                "--out", str(out / f"part-{i}"), *child_args] + [a for op in part_ops for a in ("--op", op)]
        procs.append(subprocess.Popen(argv, env=env))
    codes = [p.wait() for p in procs]
    frames = [reports.load_run(out / f"part-{i}")[0] for i in range(len(procs)) if (out / f"part-{i}" / "meta.json").exists()]
    worst = max(codes) if len(frames) == len(procs) else max(max(codes), 1)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(), worst
