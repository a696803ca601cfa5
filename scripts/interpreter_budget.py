"""What the CPU gate asks of the Triton interpreter, seed by seed, without running a case.

Draws every case the gate's interpreted campaigns (the `triton` implementations on CPU) would
draw for each seed, with the corpus, and prints the interpreter seconds `equivalence.cases.cost`
estimates for them: per gate, per property or op (the largest), and the largest cases overall.
`--no-budget` draws as before the profile's interpreter budget existed, for comparison.

    .venv/bin/python scripts/interpreter_budget.py 1 13              # seeds 1..12, profile ci
    .venv/bin/python scripts/interpreter_budget.py 1 13 --no-budget
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io

from mla_verify.equivalence import catalog
from mla_verify.equivalence.cases.profiles import get_profile
from mla_verify.fuzz.campaign import Campaign, UnderTest, each, fuzz
from mla_verify.fuzz.regressions import corpus


def gate_cases(profile, seed: int):
    """(op, case, estimated seconds) of every case the gate's interpreted campaigns run at `seed`."""
    for op in catalog.select(["op", "property"]):
        spec = catalog.get_spec(op)
        if spec.own_processes or "triton" not in spec.subjects("cpu"):
            continue
        subject = catalog.resolve_subject(op, ("triton",), "cpu")
        for path in spec.campaigns(subject):
            drawn = [case for case, _ in corpus(op)]
            with contextlib.redirect_stderr(io.StringIO()):
                fuzz(Campaign(op, profile, spec.examples(profile), seed, UnderTest(("triton",)), path),
                     each(lambda case, source: drawn.append(case) or []))
            for case in drawn:
                yield op, case, spec.interpreted_s(spec.params_of(case.params))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=int)
    parser.add_argument("stop", type=int)
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--no-budget", action="store_true", help="draw without the interpreter budget")
    args = parser.parse_args()
    profile = get_profile(args.profile)
    if args.no_budget:
        profile = dataclasses.replace(profile, interpreter_s=None)
    largest = []
    for seed in range(args.first, args.stop):
        per_op = collections.Counter()
        for op, case, seconds in gate_cases(profile, seed):
            per_op[op] += seconds
            largest.append((seconds, seed, case))
        heaviest = " ".join(f"{op.removeprefix('property:')}={s:.0f}" for op, s in per_op.most_common(3))
        print(f"seed {seed:4d}: {sum(per_op.values()):6.1f} s interpreted; heaviest {heaviest}", flush=True)
    for seconds, seed, case in sorted(largest, key=lambda t: -t[0])[:5]:
        print(f"{seconds:6.1f} s  seed {seed}: {case.short()}")


if __name__ == "__main__":
    main()
