"""The oracle catches every bug of the zoo within a campaign of the `ci` profile (the gate's) and
of `dev` (fuzz's default on CPU), at the profile's own budget of examples.

Each campaign starts with the op's covering set (equivalence.coverage.sets), then draws at random; each
zoo member is fuzzed with a fresh, printed seed until the first discrepancy; the session summary
prints the zoo's score and the examples each bug took to be found.
"""

import statistics

import pytest

from mla_verify.equivalence.catalog import evaluate, resolve_subject
from mla_verify.equivalence.cases.profiles import get_profile
from mla_verify.fuzz.campaign import Campaign, UnderTest, each, fuzz, new_seed
from tests.zoo import ZOO

PROFILES = ("ci", "dev")
FOUND: dict[str, int | None] = {}


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("bug", ZOO, ids=[b.name for b in ZOO])
def test_zoo_bug_is_caught(bug, profile):
    seed, budget = new_seed(), get_profile(profile).examples
    subject = resolve_subject(bug.op, [bug.impl], "cpu")
    result = fuzz(Campaign(bug.op, get_profile(profile), budget, seed, UnderTest((bug.impl,)), path=bug.path, shrink=False),
                  each(lambda case, source: evaluate(case, subject, "cpu", source=source)))
    FOUND[f"{bug.name} ({profile})"] = result.first_failure_at
    print(f"{bug.name}: profile {profile}, seed {seed}, first failure at example {result.first_failure_at}")
    assert result.failure is not None, f"{bug.name} ({bug.bug_class}) escaped {budget} {profile} examples (seed {seed})"
    assert not all(r.passed for r in result.failure.rows)


def zoo_summary() -> list[str]:
    if not FOUND:
        return []
    caught = [n for n in FOUND.values() if n is not None]
    lines = [f"bug zoo: {len(caught)}/{len(FOUND)} caught within each profile's budget ({', '.join(PROFILES)}); "
             f"median examples to the first failure {statistics.median(caught) if caught else 'n/a'}"]
    lines += [f"  {name:44s} {n if n is not None else 'ESCAPED'}" for name, n in sorted(FOUND.items())]
    return lines
