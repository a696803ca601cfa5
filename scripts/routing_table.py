"""How often the forward_mqa draws cross each routing boundary of the backend (equivalence.cases.routing).

    python3 scripts/routing_table.py [--draws 1000] [--profile gpu --profile nightly] [--seed 0]

Draws forward_mqa batches as a fuzz campaign does (the unrestricted draw, Hypothesis's generate
phase, seeded) and prints, per boundary and side, the share of draws on that side in each profile,
as a Markdown table (docs/scope.md's). Exit 1 when a side of a boundary was never drawn.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter


def count(profile_name: str, draws: int, seed: int) -> tuple[Counter, int]:
    """(side -> draws on it, draws made) over `draws` forward_mqa batches of the profile."""
    from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings

    from mla_verify.equivalence.cases.draws import forward_params
    from mla_verify.equivalence.cases.profiles import get_profile
    from mla_verify.equivalence.cases.routing import sides

    counts: Counter = Counter()
    made = [0]

    @hypothesis_seed(seed)
    @settings(max_examples=draws, deadline=None, database=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(forward_params(get_profile(profile_name)))
    def draw(params):
        made[0] += 1
        for boundary, found in sides(params).items():
            counts.update((boundary, side) for side in found)

    draw()
    return counts, made[0]


def table(results: dict[str, tuple[Counter, int]]) -> list[str]:
    from mla_verify.equivalence.cases.routing import SIDES

    names = list(results)
    lines = ["| boundary | side | " + " | ".join(f"{n} ({results[n][1]} draws)" for n in names) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in names) + " |"]
    for boundary, sides in SIDES.items():
        for side in sides:
            cells = [f"{100 * results[n][0][(boundary, side)] / results[n][1]:.1f}%" for n in names]
            lines.append(f"| {boundary} | {side} | " + " | ".join(cells) + " |")
    return lines


def never_drawn(results: dict[str, tuple[Counter, int]]) -> list[str]:
    from mla_verify.equivalence.cases.routing import SIDES

    return [f"{name}: {boundary} / {side}" for name, (counts, _) in results.items()
            for boundary, sides in SIDES.items() for side in sides if not counts[(boundary, side)]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--draws", type=int, default=1000)
    p.add_argument("--profile", action="append", default=None, help="default: gpu and nightly")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    results = {name: count(name, args.draws, args.seed) for name in args.profile or ["gpu", "nightly"]}
    print("\n".join(table(results)))
    missing = never_drawn(results)
    for line in missing:
        print(f"never drawn: {line}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
