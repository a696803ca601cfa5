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

Features are not enough where they interact (a kernel with no instance for s_q > 1 at top-k 256
passes every feature once): an op that declares its routing parameters (`Pairs`) also holds every
pair of their values, triples where the profile's budget holds them (`coverage.pairs`), in cases
added after the features' (`pair_cases`), production sizes among the values at every profile.

A case proves what it hits: `features_of` computes its features from the tensors its op builds
(a case that claims raw scales holds a scale that is not a power of two), never from its params
alone, and `shown_of` the routing values it holds; the covering set is checked against that
(tests/test_coverage.py).
"""

from __future__ import annotations

import random
from typing import Callable

from ..cases.case import Case
from ..cases.profiles import Profile
from .pairs import Row, Tuple, covering_array, named, tuples, universe, within
from .registry import FEATURES, Coverage, Pairs

REALIZATIONS = 3  # cases built for a covering array's row until one shows its values


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
    """The op modules' coverage lives in `features`, `exact`, `forward`, `properties` and `v4`, imported on
    first use (they build inputs through the catalog, which imports this module's users)."""
    from . import exact, features, forward, properties, v4  # noqa: F401  (they register on import)


def features_of(case: Case, device: str = "cpu", path: str | None = None) -> set[str]:
    """The features `case` hits, computed from the tensors its op builds from it."""
    return _read(case, device, path)[0]


def shown_of(case: Case, device: str = "cpu", path: str | None = None) -> Row:
    """The values of its op's routing parameters (`Pairs`) that `case`'s tensors show ({} where
    the op declares none)."""
    return _read(case, device, path)[1]


def _read(case: Case, device: str, path: str | None) -> tuple[set[str], Row]:
    """(features, routing values) of `case`, from the tensors its op builds from it, built once."""
    from ..catalog import get_spec

    cov = coverage_of(case.op, path)
    if cov is None:
        return set(), {}
    spec = get_spec(case.op)
    params = spec.params_of(case.params)
    kwargs = spec.inputs(params, case.seed, device)
    shown = cov.pairs.shown(params, kwargs) if cov.pairs is not None else {}
    return cov.hits(params, kwargs) & set(cov.features), shown


def row_cost(op: str, pairs: Pairs, profile: Profile):
    """The interpreter's seconds (`cases.cost`) for the case a covering array's row of `op` makes."""
    from ..catalog import get_spec

    spec = get_spec(op)
    return lambda row: spec.interpreted_s(spec.params_of(pairs.realize(random.Random(0), profile, row)))


def wanted(op: str, pairs: Pairs, profile: Profile) -> tuple[set[Tuple], set[Tuple]]:
    """(every tuple of `pairs`' factors at `profile`, those an interpreted campaign's covering set
    holds: within its budget a case, `Pairs.cap`)."""
    factors = pairs.factors(profile)
    t = min(pairs.strength_at(profile), len(factors))
    return (universe(factors, t, pairs.allowed),
            universe(factors, t, within(factors, pairs.allowed, row_cost(op, pairs, profile), pairs.cap(profile))))


def held(pairs: Pairs, profile: Profile, shown: list[Row]) -> set[Tuple]:
    """The tuples of `pairs`' factors at `profile` that cases showing `shown` hold together."""
    factors = pairs.factors(profile)
    names, values = [f.name for f in factors], {f.name: f.values for f in factors}
    t = min(pairs.strength_at(profile), len(factors))
    return set().union(*(tuples({k: v for k, v in row.items() if k in values and v in values[k]}, names, t)
                         for row in shown))


def covering_set(op: str, profile: Profile, seed: int, path: str | None = None,
                 admit: Callable[[Case], bool] = lambda case: True, device: str = "cpu",
                 world_size: int | None = None, interpreted: bool = False) -> list[Case]:
    """The first cases of a campaign of `op` (at `path`) within `profile`: the cases hitting every
    feature (`feature_set`), then those holding the routing values' tuples (`pair_cases`; for an
    `interpreted` campaign those whose cheapest case the interpreter runs within the op's
    `Pairs.cap`). Deterministic from `seed`."""
    cov = coverage_of(op, path)
    if cov is None:
        return []
    rng = random.Random(f"{op}/{path}/{profile.name}/{seed}")
    chosen = _features(op, cov, profile, rng, path, admit, device, world_size)
    if cov.pairs is not None:

        def build(params: dict, rng: random.Random) -> tuple[Case, Row] | None:
            case = Case(op, params if world_size is None else {**params, "dcp_size": world_size}, rng.randrange(2**31))
            return (case, shown_of(case, device, path)) if admit(case) else None

        chosen += pair_cases(op, cov.pairs, profile, rng, [shown for _, shown in chosen], build,
                             cov.pairs.cap(profile) if interpreted else None)
    return [case for case, _ in chosen]


def feature_set(op: str, profile: Profile, seed: int, path: str | None = None,
                admit: Callable[[Case], bool] = lambda case: True, device: str = "cpu",
                world_size: int | None = None) -> list[Case]:
    """The cases of `covering_set` that hit every feature, before those of the routing tuples."""
    cov = coverage_of(op, path)
    if cov is None:
        return []
    rng = random.Random(f"{op}/{path}/{profile.name}/{seed}")
    return [case for case, _ in _features(op, cov, profile, rng, path, admit, device, world_size)]


def _features(op: str, cov: Coverage, profile: Profile, rng: random.Random, path: str | None,
              admit: Callable[[Case], bool], device: str, world_size: int | None) -> list[tuple[Case, Row]]:
    """Candidates derived from `rng`, those `admit` takes (an interpreted kernel's budget), picked
    greedily, each the one hitting most features not hit yet (on a tie the smaller problem, then
    the earlier: a layout or an edge left for the last picks rides on the cheapest case that shows
    it), until no candidate adds one; with the routing values each shows. Features are read from
    inputs built on `device`, as the campaign builds them (a case's tensors depend on the device
    type). A multi-process op's candidates take the campaign's `world_size` (None: as proposed)."""
    from ..catalog import get_spec

    spec = get_spec(op)
    pool = []
    for params in cov.candidates(rng, profile):
        if world_size is not None:
            params = {**params, "dcp_size": world_size}
        case = Case(op, params, rng.randrange(2**31))
        if admit(case):
            pool.append((case, *_read(case, device, path), spec.params_of(case.params).elements()))
    chosen, missing = [], set(cov.features)
    while missing and pool:
        best = max(range(len(pool)), key=lambda i: (len(pool[i][1] & missing), -pool[i][3], -i))
        case, hit, shown, _ = pool.pop(best)
        if not hit & missing:
            break
        chosen.append((case, shown))
        missing -= hit
    return chosen


Build = Callable[[dict, random.Random], "tuple[Case, Row] | None"]  # params -> (case, its routing values), None: not admitted


def pair_cases(op: str, pairs: Pairs, profile: Profile, rng: random.Random, shown: list[Row], build: Build,
               cap: float | None = None) -> list[tuple[Case, Row]]:
    """The cases (with the values they show) that hold, beside cases showing `shown`, every tuple
    of `pairs`' factors at `profile` whose cheapest case costs at most `cap` interpreter seconds:
    a covering array's rows, each realized as a case (`build`), kept where its tensors show a
    tuple not held yet."""
    factors = pairs.factors(profile)
    names = [f.name for f in factors]
    t = min(pairs.strength_at(profile), len(factors))
    have, found = held(pairs, profile, shown), []
    for row in covering_array(factors, t, rng, pairs.allowed, have, row_cost(op, pairs, profile), cap):
        built = None
        for _ in range(REALIZATIONS):  # a drawn length may miss what the row asks: another seed
            built = build(pairs.realize(rng, profile, row), rng) or built
            if built is not None and built[1] == row:
                break
        new = tuples(built[1], names, t) - have if built is not None else set()
        if new:
            found.append(built)
            have |= new
    return found


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
            + ["| " + " | ".join(row) + " |" for row in cells.values()] + pair_table(op, profiles, seed, path))


def pair_table(op: str, profiles: list[Profile], seed: int = 0, path: str | None = None) -> list[str]:
    """The routing values and the tuples of them each profile's covering set holds (`list --op OP
    --coverage`): per profile the values, the strength, and per group of factors the tuples held
    of those that exist, each held tuple named; nothing where the op declares no factors."""
    cov = coverage_of(op, path)
    if cov is None or cov.pairs is None:
        return []
    lines = []
    for p in profiles:
        factors, t = cov.pairs.factors(p), min(cov.pairs.strength_at(p), len(cov.pairs.factors(p)))
        have = held(cov.pairs, p, [shown_of(case, path=path) for case in covering_set(op, p, seed, path)])
        every, interpreted = wanted(op, cov.pairs, p)
        kind = {1: "values", 2: "pairs"}.get(t, f"{t}-tuples")
        lines += ["", f"{p.name}: {len(have & every)} of {len(every)} {kind} of "
                  f"{' x '.join(f.name for f in factors)} held (seed {seed}); values: "
                  + "; ".join(f"{f.name} {', '.join(map(str, f.values))}" for f in factors)]
        if every - interpreted:
            lines.append(f"  interpreted Triton kernels: {len(interpreted)} of them, within "
                         f"{cov.pairs.cap(p):g} s a case (`Pairs.cap`); past it: "
                         + ", ".join(named(tup) for tup in sorted(every - interpreted, key=repr)))
        groups: dict[tuple[str, ...], list[Tuple]] = {}
        position = {f.name: f.values for f in factors}
        for tup in sorted(every, key=lambda tup: [position[n].index(v) for n, v in tup]):
            groups.setdefault(tuple(name for name, _ in tup), []).append(tup)
        for group, tups in groups.items():
            held_here = [tup for tup in tups if tup in have]
            missed = [named(tup) for tup in tups if tup not in have]
            lines.append(f"  {' x '.join(group)}: {len(held_here)}/{len(tups)}: "
                         + ", ".join(" x ".join(str(v) for _, v in tup) for tup in held_here)
                         + (f"; MISSED {', '.join(missed)}" if missed else ""))
    return lines
