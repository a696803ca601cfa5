"""The tests' shorthand for a case judged through an isolation worker (`equivalence.blocks.Judging`)."""

from mla_verify.equivalence.blocks import Judging
from mla_verify.equivalence.judge.rows import RowContext


def judged(judging: Judging, case, specs, label: str | None = None, **context) -> list:
    """The rows of `case` with the implementation the --impl strings `specs` name, judged by
    `judging` (its worker imports the implementation), labelled `label` (by default as the judge
    knows it); `context`: the rest of the rows' context (run_id, source, notes)."""
    subject = judging.subject(case.op, specs)
    return judging.case(case, subject, RowContext(label=label or subject.label, device=judging.device, **context))
