"""The oracle catches every bug of the zoo within the `ci` fuzz profile's budget.

Each zoo member (tests/zoo) is fuzzed with a fresh, printed seed until the first discrepancy; the
session summary prints the zoo's score and the examples each bug took to be found.
"""

import statistics

import pytest

from mla_verify.equivalence.catalog import evaluate, resolve_subject
from mla_verify.equivalence.profiles import get_profile
from mla_verify.fuzz.campaign import Campaign, each, fuzz, new_seed
from tests.zoo import ZOO

BUDGET = 200  # examples per bug; the slowest measured (multi-chunk prefill bugs) need ~25 on median
FOUND: dict[str, int | None] = {}


@pytest.mark.parametrize("bug", ZOO, ids=[b.name for b in ZOO])
def test_zoo_bug_is_caught(bug):
    seed = new_seed()
    subject = resolve_subject(bug.op, [bug.impl], "cpu")
    result = fuzz(Campaign(bug.op, get_profile("ci"), BUDGET, seed, path=bug.path, shrink=False),
                  each(lambda case, source: evaluate(case, subject, "cpu", source=source)))
    FOUND[bug.name] = result.first_failure_at
    print(f"{bug.name}: seed {seed}, first failure at example {result.first_failure_at}")
    assert result.failure is not None, f"{bug.name} ({bug.bug_class}) escaped {BUDGET} examples (seed {seed})"
    assert not all(r.passed for r in result.failure.rows)


def zoo_summary() -> list[str]:
    if not FOUND:
        return []
    caught = [n for n in FOUND.values() if n is not None]
    lines = [f"bug zoo: {len(caught)}/{len(FOUND)} caught within {BUDGET} ci examples; "
             f"median examples to the first failure {statistics.median(caught) if caught else 'n/a'}"]
    lines += [f"  {name:38s} {n if n is not None else 'ESCAPED'}" for name, n in sorted(FOUND.items())]
    return lines
