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
from tests.zoo import SERVING_SHAPES, ZOO

PROFILES = ("ci", "dev")
FOUND: dict[str, int | None] = {}


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("bug", ZOO, ids=[b.name for b in ZOO])
def test_zoo_bug_is_caught(bug, profile):
    seed, budget = new_seed(), get_profile(profile).examples
    subject = resolve_subject(bug.op, [bug.impl], "cpu")
    # No re-runs: whether a finding is flaky, and its traced stage, are the gate's to tell
    # (tests/test_hostile.py, tests/test_stage_verdicts.py); here the first failing case ends the campaign.
    result = fuzz(Campaign(bug.op, get_profile(profile), budget, seed, UnderTest((bug.impl,)), path=bug.path,
                           shrink=False, reruns=0),
                  each(lambda case, source: evaluate(case, subject, "cpu", source=source)))
    FOUND[f"{bug.name} ({profile})"] = result.first_failure_at
    print(f"{bug.name}: profile {profile}, seed {seed}, first failure at example {result.first_failure_at}")
    assert result.failure is not None, f"{bug.name} ({bug.bug_class}) escaped {budget} {profile} examples (seed {seed})"
    assert not all(r.passed for r in result.failure.rows)


def _first_failure(bug, profile: str, seed: int, examples: int) -> int | None:
    subject = resolve_subject(bug.op, [bug.impl], "cpu")
    result = fuzz(Campaign(bug.op, get_profile(profile), examples, seed, UnderTest((bug.impl,)), path=bug.path,
                           shrink=False, reruns=0),
                  each(lambda case, source: evaluate(case, subject, "cpu", source=source)))
    return result.first_failure_at


@pytest.mark.slow
@pytest.mark.parametrize("bug", SERVING_SHAPES, ids=[b.name for b in SERVING_SHAPES])
def test_serving_shapes_are_caught_at_ci_on_seeds_1_2_3_and_within_100_default_examples(bug):
    """Issue 47's must-show: each of these escaped `ci` on seeds 1, 2 and 3 (and 6 of them 100
    examples of `dev`, the default on CPU) before the covering sets held pairs, production sizes,
    every small value and serving's shapes."""
    found = {f"ci seed {seed}": _first_failure(bug, "ci", seed, get_profile("ci").examples) for seed in (1, 2, 3)}
    found["dev, 100 examples"] = _first_failure(bug, "dev", 1, 100)
    print(f"{bug.name}: first failure at {found}")
    assert None not in found.values(), f"{bug.name} ({bug.bug_class}) escaped: {found}"


def zoo_summary() -> list[str]:
    if not FOUND:
        return []
    caught = [n for n in FOUND.values() if n is not None]
    lines = [f"bug zoo: {len(caught)}/{len(FOUND)} caught within each profile's budget ({', '.join(PROFILES)}); "
             f"median examples to the first failure {statistics.median(caught) if caught else 'n/a'}"]
    lines += [f"  {name:44s} {n if n is not None else 'ESCAPED'}" for name, n in sorted(FOUND.items())]
    return lines
