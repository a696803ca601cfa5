"""The pytest plugin's fixtures (registered by `mla_verify.pytest_plugin` when pytest configures):
the common cases of a kernel repository's tests, with what a team keeps between sessions.

    def test_prefill(mla_check):
        mla_check("sparse_prefill", sparse_prefill)   # the CLI's report fails the test; findings kept

    def test_decode_keeps_its_findings(mla_corpus):
        mla_verify.check("sparse_decode_fp8", decode, corpus=mla_corpus)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from mla_verify.pytest_plugin import DEFAULTS, kept


@pytest.fixture
def mla_corpus(pytestconfig) -> Path:
    """The kept corpus directory: `--mla-verify-corpus DIR`, else ROOTDIR/.mla-verify/corpus. Every
    check given it replays its cases of the op and implementation first, whatever the seed, and adds
    its finding (`mla_verify.runs.corpus`), so a bug found once is checked by every later session."""
    return Path(DEFAULTS["corpus"]).absolute() if "corpus" in DEFAULTS else kept(pytestconfig.rootpath, "corpus")


@pytest.fixture
def mla_check(mla_corpus: Path) -> Callable[..., Any]:
    """`mla_verify.assert_equivalent(op, impl, **kwargs)` with the kept corpus (`mla_corpus`) unless
    the call names its own corpus=: returns the CheckResult, and fails the test with the CLI's report
    (the minimized case, its file under the kept failures directory and its replay command)."""
    from mla_verify import api

    def check(op: str, impl: Any = None, **kwargs: Any):
        __tracebackhide__ = True  # the failure ends at the test's call
        kwargs.setdefault("corpus", mla_corpus)
        return api.assert_equivalent(op, impl, **kwargs)

    return check
