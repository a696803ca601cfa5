"""A decline must depend on the params, not the values (issue 45, item 5).

An implementation may decline a case it does not take (`mla_verify.unsupported`: a head count, a
top-k width it does not do yet), and a declined case is counted, not failed. A kernel that declines
by value (the cases it would get wrong) would hide its wrong answers as "not checked". So the block
runner's answer is asked again: a case declined where a case of the same params was answered (in
its block, earlier in the run, or asked here under another seed, once per params) fails its case:
`contract`, naming the seed that was answered. A run whose every case was declined judged nothing,
which `runs.outcome` ends as NO VERDICT, never a pass.
"""

from __future__ import annotations

import json
from dataclasses import replace

from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.judge.rows import FailureKind, Row
from mla_verify.fuzz.campaign import Judge

UNSUPPORTED = FailureKind.UNSUPPORTED


def declined(rows: list[Row] | None) -> bool:
    """Whether a case's rows say the implementation declined it (and nothing else)."""
    return bool(rows) and all(r.gate_metric == UNSUPPORTED for r in rows)


def _params(case: Case) -> str:
    return json.dumps([case.op, case.params], sort_keys=True)


def asked_again(judge: Judge) -> Judge:
    """`judge` (a block runner) whose declined cases fail where the same params were answered; a
    declined case's params not answered yet are asked once more under seed + 1."""
    answered: dict[str, int | None] = {}  # params -> a seed they were answered under (None: declined there too)

    def judging(cases: list[Case], source: str, on_call) -> list[list[Row] | None]:
        found = judge(cases, source, on_call)
        for case, rows in zip(cases, found):
            if rows and not declined(rows):
                answered[_params(case)] = case.seed
        for i, (case, rows) in enumerate(zip(cases, found)):
            if not declined(rows):
                continue
            key = _params(case)
            if key not in answered:
                other = Case(case.op, case.params, case.seed + 1)
                again, = judge([other], source, lambda: None)
                answered[key] = None if not again or declined(again) else other.seed
            if answered[key] is not None:
                found[i] = [_declined_by_value(rows[0], answered[key])]
        return found

    return judging


def _declined_by_value(row: Row, seed: int) -> Row:
    why = row.reason.removeprefix(f"{UNSUPPORTED}: ")
    return replace(row, passed=False, gate_metric=FailureKind.CONTRACT, value=1.0, bound=0.0, headroom=0.0,
                   reason=f"declined this case ({why}) where it answered the same params under seed {seed}: a "
                          "decline must depend on the params, not the values")
