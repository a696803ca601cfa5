"""The tests a kernel repository keeps next to its kernel (README "Verify your kernel in 5
minutes"). Budget, profile and device come from the command line, so a CI can raise them without
editing this file: `pytest --mla-verify-examples 200 --mla-verify-device cuda`."""

import mla_verify
from my_kernel import sparse_prefill


def test_sparse_prefill_matches_the_reference():
    mla_verify.assert_equivalent("sparse_prefill", sparse_prefill)


def test_sparse_prefill_inside_vllms_forward_mqa(tmp_path):
    # The whole bf16 forward_mqa path with this kernel as its prefill stage, the other stages the project's.
    result = mla_verify.check("forward_mqa", {"sparse_prefill": sparse_prefill}, path="bf16", out=tmp_path / "run")
    assert result.passed, result.report()
