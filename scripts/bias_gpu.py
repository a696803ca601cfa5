"""Measured bias per path: every implementation here against the exact reference, one table.

    PYTHONPATH=/tmp/site:$PWD python3 scripts/bias_gpu.py [--examples N] [--seed S] [--out DIR]
                                                         [--op OP ...] [--impl NAME ...] [--device cuda|cpu]

For sparse_prefill and sparse_decode_fp8 and each implementation that runs here (on an H200:
flash_mla, triton, torch-fp32), N cases of the `gpu` profile (`ci` on CPU) of one seed, so that
the implementations meet the same cases. Prints, per (op, implementation, deviation) group, the
bias statistics of `reports.bias` (the mean over cases, each case one sample, with its t interval
at 0.99): the output's gain <impl - ref, ref> / <ref, ref>, its mean signed error in bf16 ulps,
and the LSE's in fp32 steps of the logit scale; a group whose whole interval lies beyond the
floor is marked biased. Then each implementation against torch-fp32 on the shared cases (the
paired shift, as `report --baseline` judges it). Rows with the bf16_cache_scale deviation are the
SM90 decode kernel's raw-scale cases: their line answers whether its bf16 scale rounding shows as
bias. Writes each run under --out (`mla-verify report DIR`) and the tables to --out/bias.md.
Budget: about 3 minutes on an H200 at the default 120 cases (most of it compiling Triton and
building decode caches); exit 1 when a row failed its bound.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import pandas as pd

OPS = ("sparse_prefill", "sparse_decode_fp8")
IMPLS = ("flash_mla", "triton", "torch-fp32")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when present")
    p.add_argument("--op", action="append", default=None, choices=OPS, help="default: both")
    p.add_argument("--impl", action="append", default=None, metavar="NAME", help="default: every one that runs here")
    p.add_argument("--examples", type=int, default=120)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/bias"))
    p.add_argument("--no-covering-set", dest="covering", action="store_false",
                   help="the N cases drawn alone (tests/test_bias.py on CPU); default: each op's covering set first")
    return p.parse_args(argv)


def _pm(mean: float, ci: float) -> str:
    return f"{mean:+.2e} ± {ci:.1e}" if ci == ci else f"{mean:+.2e}"


def bias_table(rows: pd.DataFrame) -> list[str]:
    """Markdown: one line per (op, implementation, deviation), the out and lse bias statistics."""
    from mla_verify.reports.bias import BIASED, bias_of

    t = bias_of(rows).table
    lines = ["| op | implementation | deviation | cases | out gain | out bias (bf16 ulps) | lse offset (fp32 steps) | biased |",
             "|---|---|---|---|---|---|---|---|"]
    for (op, impl, dev), g in t.groupby(["op", "impl", "deviation"], sort=True):
        cell = {(r.tensor, r.metric): r for r in g.itertuples()}
        gain, units, lse = (cell.get(k) for k in (("out", "gain"), ("out", "bias_units"), ("lse", "bias_units")))
        flagged = ", ".join(f"{r.tensor} {r.metric}" for r in g.itertuples() if r.finding == BIASED) or "no"
        lines.append(f"| {op} | {impl} | {dev or '-'} | {max(r.cases for r in g.itertuples())} | "
                     + " | ".join(_pm(c.mean, c.ci) if c is not None else "-" for c in (gain, units, lse))
                     + f" | {flagged} |")
    return lines


def paired_table(runs: dict[tuple[str, str], pd.DataFrame]) -> list[str]:
    """Markdown: each implementation's shift of bias against torch-fp32's, on their shared cases."""
    from mla_verify.reports.drift import compare

    lines = ["| op | implementation vs torch-fp32 | deviation | tensor | metric | paired cases | shift | drift |",
             "|---|---|---|---|---|---|---|---|"]
    for (op, impl), rows in sorted(runs.items()):
        base = runs.get((op, "torch-fp32"))
        if impl == "torch-fp32" or base is None:
            continue
        m = compare(rows, base, pairs={impl: "torch-fp32"}).metrics
        for r in m[m["metric"].isin(["gain", "bias_units"]) & (m["mode"] == "paired")].itertuples():
            lines.append(f"| {op} | {impl} | {r.deviation or '-'} | {r.tensor} | {r.metric} | {r.paired_cases} | "
                         f"{_pm(r.shift, r.shift_ci)} | {r.finding or 'no'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from mla_verify import api
    from mla_verify.equivalence.catalog import resolve_subject
    from mla_verify.equivalence.errors import UsageError

    device = api.resolve_device(args.device)
    profile = "gpu" if device.startswith("cuda") else "ci"
    runs, failed = {}, False
    for op in args.op or OPS:
        for impl in args.impl or IMPLS:
            try:
                resolve_subject(op, (impl,), device.split(":")[0])
            except UsageError as exc:
                print(f"{op} {impl}: skipped ({exc})", flush=True)
                continue
            out = args.out / f"{op}-{impl}"
            shutil.rmtree(out, ignore_errors=True)
            result = api.check(op, impl, examples=args.examples, seed=args.seed, device=device, profile=profile,
                               out=out, isolate=False, shrink=False, covering=args.covering,
                               log=lambda line: print(line, flush=True))
            print(result.report(), flush=True)
            failed |= not result.passed
            runs[(op, impl)] = result.rows
    if not runs:
        print("nothing ran", file=sys.stderr)
        return 2
    text = ["## Bias per path against the exact reference (0.99 t intervals, cases as samples)", "",
            *bias_table(pd.concat(runs.values(), ignore_index=True)), "",
            "## Against torch-fp32 on the same cases (paired shift)", "", *paired_table(runs)]
    print("\n".join(text))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bias.md").write_text("\n".join(text) + "\n")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
