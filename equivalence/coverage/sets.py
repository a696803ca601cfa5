"""Covering sets: the first cases of every campaign, chosen so that together they hit every
feature of the op (or forward_mqa path) at least once, whatever the profile.

A profile's random draws reach what its sizes allow: `ci` never draws two prefill requests of
convert_index nor more than 64 tokens, and a multi-chunk split end first appears at example 168 of
`dev`. So each op and path lists its features (`FEATURES`: the routing boundaries of
`equivalence.cases.routing` and the edge classes of its inputs), proposes candidate cases derived from
the campaign's seed (`Coverage.candidates`, within the profile's head counts and top-k values where
the feature allows), and a greedy covering design picks the fewest candidates that hit them all
(`covering_set`). The campaign runs those first, then draws at random as before
(`fuzz.campaign.fuzz`).

A case proves what it hits: `features_of` computes its features from the tensors its op builds
(a case that claims raw scales holds a scale that is not a power of two), never from its params
alone; the covering set is checked against that (tests/test_coverage.py).
"""

from __future__ import annotations

import random
from typing import Callable

from ..cases.case import Case
from ..cases.profiles import Profile
from .registry import FEATURES, Coverage


def coverage_of(op: str, path: str | None = None) -> Coverage | None:
    """The coverage of `op` at `path` (None: the op drawn without --path), or None where the op
    lists no features (it starts with random draws)."""
    _load()
    return FEATURES.get((op, path))


def covered() -> list[tuple[str, str | None]]:
    """Every (op, path) that lists features."""
    _load()
    return list(FEATURES)


def _load() -> None:
    """The op modules' coverage lives in `features`, `exact` and `forward`, imported on first use (they build inputs through the catalog, which
    imports this module's users)."""
    from . import exact, features, forward  # noqa: F401  (they register on import)


def features_of(case: Case, device: str = "cpu", path: str | None = None) -> set[str]:
    """The features `case` hits, computed from the tensors its op builds from it."""
    from ..catalog import get_spec

    cov = coverage_of(case.op, path)
    if cov is None:
        return set()
    spec = get_spec(case.op)
    params = spec.params_of(case.params)
    return cov.hits(params, spec.inputs(params, case.seed, device)) & set(cov.features)


def covering_set(op: str, profile: Profile, seed: int, path: str | None = None,
                 admit: Callable[[Case], bool] = lambda case: True, device: str = "cpu",
                 world_size: int | None = None) -> list[Case]:
    """The first cases of a campaign of `op` (at `path`) within `profile`: candidates derived from
    `seed`, those `admit` takes (an interpreted kernel's budget), picked greedily, each the one
    hitting most features not hit yet (on a tie the smaller problem, then the earlier: a layout
    or an edge left for the last picks rides on the cheapest case that shows it), until no
    candidate adds one. Their
    features are read from inputs built on `device`, as the campaign builds them (a case's
    tensors depend on the device type). A multi-process op's candidates take the campaign's
    `world_size` (None: as proposed)."""
    from ..catalog import get_spec

    cov = coverage_of(op, path)
    if cov is None:
        return []
    rng = random.Random(f"{op}/{path}/{profile.name}/{seed}")
    spec = get_spec(op)
    pool = []
    for params in cov.candidates(rng, profile):
        if world_size is not None:
            params = {**params, "dcp_size": world_size}
        case = Case(op, params, rng.randrange(2**31))
        if admit(case):
            pool.append((case, features_of(case, device, path), spec.params_of(case.params).elements()))
    chosen, missing = [], set(cov.features)
    while missing and pool:
        best = max(range(len(pool)), key=lambda i: (len(pool[i][1] & missing), -pool[i][2], -i))
        case, hit, _ = pool.pop(best)
        if not hit & missing:
            break
        chosen.append(case)
        missing -= hit
    return chosen


def random_hits(op: str, profile: Profile, draws: int, seed: int = 0, path: str | None = None) -> tuple[dict[str, int], int]:
    """(feature -> how many of the op's random draws within `profile` hit it, draws made): the
    campaign's draws without the covering set (Hypothesis's generate phase, seeded)."""
    from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings

    from ..catalog import get_spec

    cov = coverage_of(op, path)
    counts, made = {name: 0 for name in (cov.features if cov else ())}, [0]

    @settings(max_examples=draws, database=None, deadline=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @hypothesis_seed(seed)
    @given(case=get_spec(op).strategy(profile, path))
    def count(case: Case) -> None:
        made[0] += 1
        for name in features_of(case, path=path):
            counts[name] += 1

    count()
    return counts, made[0]


def table(op: str, profiles: list[Profile], draws: int, seed: int = 0, path: str | None = None) -> list[str]:
    """`mla-verify list --op OP --coverage`: per profile, which features the covering set of `seed`
    hits (its size in the header) and the share of `draws` random draws hitting each, Markdown."""
    cov = coverage_of(op, path)
    if cov is None:
        return [f"{op}{f' --path {path}' if path else ''} lists no features: its campaigns start with random draws"]
    head, cells = ["feature"], {name: [name] for name in cov.features}
    for p in profiles:
        first = covering_set(op, p, seed, path)
        hit = set().union(*(features_of(case, path=path) for case in first))
        counts, made = random_hits(op, p, draws, seed, path)
        head += [f"{p.name}: first {len(first)}", f"{p.name}: {made} draws"]
        for name in cov.features:
            cells[name] += ["hit" if name in hit else "MISSED", f"{100 * counts[name] / max(made, 1):.1f}%"]
    return (["| " + " | ".join(head) + " |", "|" + " --- |" + " :-: | ---: |" * len(profiles)]
            + ["| " + " | ".join(row) + " |" for row in cells.values()])
