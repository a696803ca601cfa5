"""The tests' shorthand for a case judged through an isolation worker (`equivalence.blocks.Judging`),
and for whether a process it started is gone."""

from mla_verify.equivalence.blocks import Judging
from mla_verify.equivalence.judge.rows import RowContext


def judged(judging: Judging, case, specs, label: str | None = None, **context) -> list:
    """The rows of `case` with the implementation the --impl strings `specs` name, judged by
    `judging` (its worker imports the implementation), labelled `label` (by default as the judge
    knows it); `context`: the rest of the rows' context (run_id, source, notes)."""
    subject = judging.subject(case.op, specs)
    return judging.case(case, subject, RowContext(label=label or subject.label, device=judging.device, **context))


def gone(pid: int) -> bool:
    """Whether process `pid` has ended (no longer there, or a zombie not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True
