"""A fuzz campaign: Hypothesis draws cases for one op, the oracle judges each, and the first
discrepancy is shrunk to the smallest case that still fails and saved as a replayable file."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from mla_verify.equivalence.case import Case
from mla_verify.equivalence.rows import Row

from . import casefile
from .profiles import Profile
from .progress import Progress
from .strategies import strategy

Runner = Callable[[Case, str], list[Row]]  # (case, source) -> rows


class Discrepancy(Exception):
    def __init__(self, case: Case, rows: list[Row]):
        super().__init__(f"{case.short()}: " + "; ".join(r.reason for r in rows if not r.passed))
        self.case, self.rows = case, rows


@dataclass
class FuzzResult:
    op: str
    seed: int
    examples: int                 # cases evaluated while searching (shrink steps not counted)
    rows: list[Row] = field(default_factory=list)
    failure: Discrepancy | None = None
    first_failure_at: int | None = None   # 1-based example number of the first discrepancy
    case_file: Path | None = None


def new_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def fuzz(
    op: str,
    run: Runner,
    *,
    profile: Profile,
    examples: int,
    seed: int,
    impl_specs: tuple[str, ...] = (),
    deviations: tuple[str, ...] = (),
    device: str = "cpu",
    out_dir: Path | None = None,
    shrink: bool = True,
    progress_label: str | None = None,
    path: str | None = None,
    world_size: int | None = None,
) -> FuzzResult:
    """Run up to `examples` cases of `op`; stop at the first discrepancy and shrink it. A failing
    case is saved with `impl_specs` and the `deviations` declared for them, for replay."""
    result = FuzzResult(op, seed, 0)
    progress = Progress(progress_label or op, examples)
    state = {"shrinking": False}

    phases = (Phase.explicit, Phase.reuse, Phase.generate) + ((Phase.shrink,) if shrink else ())

    @settings(max_examples=examples, deadline=None, database=None, phases=phases, print_blob=False,
              report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
    @hypothesis_seed(seed)
    @given(case=strategy(op, profile, path, world_size))
    def search(case: Case) -> None:
        rows = run(case, "shrink" if state["shrinking"] else "fuzz")
        if not state["shrinking"]:
            result.examples += 1
            result.rows.extend(rows)
        failing = [r for r in rows if not r.passed]
        if not state["shrinking"]:
            progress.step(bool(failing))
        if failing:
            if not state["shrinking"]:
                result.first_failure_at = result.examples
            state["shrinking"] = True
            raise Discrepancy(case, rows)

    try:
        search()
    except Discrepancy as d:
        result.failure = d
        if all(r.case_id != d.case.case_id for r in result.rows):
            result.rows.extend(d.rows)  # the minimized case, found while shrinking
        if out_dir is not None:
            where = Path(out_dir) / "failures" / f"{op.replace(':', '-')}-{d.case.case_id}.json"
            found_by = (f"mla-verify fuzz --op {op}" + (f" --path {path}" if path else "")
                        + (f" --world-size {world_size}" if world_size else "") + f" --seed {seed}"
                        + "".join(f" --deviation {name}" for name in deviations))
            result.case_file = casefile.save(where, casefile.CaseFile(
                d.case, impl_specs, device, casefile.failure_summary(d.rows),
                note=f"found by `{found_by}` (profile {profile.name})", deviations=deviations))
    return result
