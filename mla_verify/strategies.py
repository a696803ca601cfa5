"""Hypothesis strategies of mla-verify Cases, for tests that compose their own `@given`.

    from hypothesis import given
    import mla_verify

    @given(case=mla_verify.strategies.cases("sparse_prefill", profile="ci"))
    def test_my_prefill(case): ...

A Case is plain data (op, params, seed); `mla_verify.replay` and `mla-verify replay` run one saved
as JSON, and `mla_verify.equivalence.catalog.evaluate(case, subject, device)` judges one in-process.
"""

from __future__ import annotations

from hypothesis import strategies as st

from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.errors import UsageError

__all__ = ["cases"]


def cases(op: str, profile: str = "ci", *, path: str | None = None,
          world_size: int | None = None) -> st.SearchStrategy[Case]:
    """Cases of `op` (an op, "forward_mqa", "dcp" or "property:NAME") within fuzz profile
    `profile` (ci | dev | nightly | gpu); `path` picks a forward_mqa path or a property's target,
    `world_size` dcp's ranks. Every case drawn is valid by the op's contract."""
    from mla_verify.equivalence.catalog import get_spec
    from mla_verify.equivalence.cases.profiles import get_profile

    try:
        return get_spec(op).strategy(get_profile(profile), path, world_size)
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
