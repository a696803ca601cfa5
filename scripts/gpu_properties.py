"""Every property (equivalence.properties) for every implementation here, at production shapes: one table.

    PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_properties.py [--impl NAME ...] [--property NAME ...]
                                    [--examples N] [--seed S] [--out DIR] [--no-pinned] [--device cuda|cpu]

For each property, each implementation of the stages it tests that runs here (on an H200:
flash_mla, triton, torch-fp32) and each target it covers: one pinned case at production shapes
(fuzz/production.py: 64-128 heads, top-k 2048, decode batches of 64), plus N cases drawn from the
`gpu` profile (the `ci` profile on CPU) with --examples N. Prints one line per (property,
check.tensor, implementation): the cases, whether the property held, whether it held bit for
bit, the gated metric with the least headroom against its bound (and the deviation that set it),
and the implementation's time; writes the rows to --out for `mla-verify report`. Exit 1 when a row
failed. Budget: about two minutes on an H200, most of it compiling the Triton kernels and
building each case's caches on the CPU (~45 s per implementation on 2 CPU cores, less on 16).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when present")
    p.add_argument("--impl", action="append", default=None, metavar="NAME", help="default: every one that runs here")
    p.add_argument("--property", action="append", default=None, metavar="NAME", help="default: every property")
    p.add_argument("--examples", type=int, default=0, help="drawn cases per property, implementation and target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/properties"))
    p.add_argument("--no-pinned", action="store_true", help="drawn cases only (a CPU run: pinned shapes are GPU-sized)")
    return p.parse_args(argv)


def summary(rows) -> list[str]:
    """One line per (property, check.tensor, implementation), worst row first within each."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r.path, r.tensor, r.impl)].append(r)
    lines = [f"{'property':22s} {'check.tensor':22s} {'impl':11s} {'cases':>5s} {'holds':5s} {'bitwise':7s} "
             f"{'worst: metric value / bound (deviation)':48s} {'s':>6s}"]
    for (path, tensor, impl), group in sorted(groups.items()):
        worst = min(group, key=lambda r: (r.passed, r.headroom))
        fractions = [r.metrics.mismatch_frac for r in group]
        bitwise = ("n/a" if all(f != f for f in fractions)  # float64 answers (a merge) have no bits to compare
                   else "yes" if all(f == 0 for f in fractions) else "no")
        detail = (f"{worst.gate_metric} {worst.value:.3g} / {worst.bound:.3g}" if worst.gate_metric != "raised"
                  else worst.reason[:60])
        detail += f" ({worst.deviation})" if worst.deviation else ""
        seconds = sum(r.time_impl_s for r in group if r.time_impl_s == r.time_impl_s)
        lines.append(f"{path:22s} {tensor:22s} {impl:11s} {len({r.case_id for r in group}):5d} "
                     f"{'yes' if all(r.passed for r in group) else 'NO':5s} {bitwise:7s} "
                     f"{detail:48s} {seconds:6.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    from mla_verify import reports
    from mla_verify.equivalence.cases.case import Case
    from mla_verify.equivalence.catalog import evaluate, resolve_subject, specs
    from mla_verify.equivalence.cases.profiles import get_profile
    from mla_verify.fuzz.campaign import Campaign, each, fuzz
    from mla_verify.runs.progress import Progress
    from mla_verify.fuzz.production import production_cases

    profile = get_profile("gpu" if device == "cuda" else "ci")
    run_id = f"properties-{time.strftime('%Y%m%d-%H%M%S')}"
    meta = reports.collect_meta(profile.name, [args.seed], device, command=shlex.join(["gpu_properties.py", *sys.argv[1:]]))
    started, rows, notes = time.monotonic(), [], set()
    for prop in [p for p in specs("property") if not args.property or p.short in args.property]:
        name = prop.short
        for impl, impl_specs in prop.subjects(device).items():
            if args.impl and impl not in args.impl:
                continue
            subject = resolve_subject(prop.name, impl_specs, device)

            def run(case: Case, source: str, subject=subject) -> list:
                return evaluate(case, subject, device, run_id=run_id, source=source, notes=notes)

            for target in prop.covered(subject.overrides):
                tick = time.monotonic()
                if not args.no_pinned:
                    rows += [row for case in production_cases(name, [target], args.seed) for row in run(case, "corpus")]
                if args.examples:
                    campaign = Campaign(prop.name, profile, args.examples, args.seed, path=target, shrink=False)
                    rows += fuzz(campaign, each(run), Progress(f"{prop.name} / {impl} / {target}", args.examples)).rows
                print(f"  {name} / {impl} / {target}: {time.monotonic() - tick:.1f} s", file=sys.stderr, flush=True)
    for note in sorted(notes):
        print(f"note: {note}")
    print("\n".join(summary(rows)))
    reports.write_run(args.out, rows, reports.finish_meta(meta))
    failed = sum(not r.passed for r in rows)
    print(f"{len(rows)} rows, {failed} failed, {time.monotonic() - started:.0f} s; rows in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
