"""Our Triton DCP merge kernels (dcp_merge, dcp_lse_correct) against the reference, held to the
rounding bound of mla_verify.equivalence.judge.bounds (section 3), and their refusal of bad inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mla_verify import reference as R
from mla_verify.equivalence.judge.bounds import dcp_merge_bounds
from mla_verify.optimized.kernels.dcp_merge import dcp_lse_correct, dcp_merge
from tests.triton_glue_helpers import (  # noqa: F401  (no_launch: a fixture)
    DEVICE, _expect_refusal, _gen, assert_same_bits, no_launch, poisoned_outputs, seeds,
)


# The merge is held to the rounding bound of mla_verify.equivalence.judge.bounds (section 3).

_EMPTINESS = ("none", "some", "junk", "all")


def _dcp_partials(gen: torch.Generator, ranks: int, tokens: int, heads: int, dim: int, empties: str):
    """Per-rank (outs [N, T, H, D] bf16, lses [N, T, H] f32) as the decode kernels leave them.

    "some": ranks owning none of a row's tokens are neutralized (0, -inf); "junk": such ranks keep
    FlashMLA's lonely-row answer (lse +inf or NaN, out NaN/inf); "all": whole rows where every
    rank is empty.
    """
    outs = torch.randn(ranks, tokens, heads, dim, generator=gen)
    lses = (torch.randn(ranks, tokens, heads, generator=gen) * 4 + 2).float()
    empty = torch.rand(ranks, tokens, heads, generator=gen) < (0.0 if empties == "none" else 0.4)
    if empties == "all":
        empty[:, torch.rand(tokens, generator=gen) < 0.5] = True
    if empties == "junk":
        lses[empty] = torch.where(torch.rand(int(empty.sum()), generator=gen) < 0.5, math.inf, math.nan)
        outs[empty] = torch.tensor([math.nan, math.inf, -math.inf])[torch.randint(0, 3, (int(empty.sum()),), generator=gen)][:, None]
    else:
        lses[empty] = -math.inf
        outs[empty] = 0.0
    return outs.to(torch.bfloat16), lses


# The interpreter's numpy warns on the -inf and NaN arithmetic the merge resolves on purpose.
_IGNORE_NUMPY_WARNINGS = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


@_IGNORE_NUMPY_WARNINGS
@settings(max_examples=30, deadline=None)
@given(
    ranks=st.integers(1, 8), tokens=st.integers(1, 4), heads=st.integers(1, 9),
    dim=st.sampled_from([16, 100, 512]), empties=st.sampled_from(_EMPTINESS), seed=seeds,
)
def test_triton_dcp_merge_and_dcp_lse_correct_match_reference(ranks, tokens, heads, dim, empties, seed):
    outs, lses = _dcp_partials(_gen(seed), ranks, tokens, heads, dim, empties)
    out_ref, lse_ref = R.dcp_merge(outs, lses)
    with poisoned_outputs():
        out, lse = dcp_merge(outs.to(DEVICE), lses.to(DEVICE))
    out, lse = out.cpu(), lse.cpu()
    assert not out.isnan().any() and not lse.isnan().any()
    tol_out, tol_lse = dcp_merge_bounds(outs, lses, out_ref, lse_ref)
    assert torch.equal(lse.isinf(), lse_ref.isinf()) and torch.equal(lse[lse.isinf()], lse_ref[lse_ref.isinf()].float())
    finite = lse_ref.isfinite()
    assert bool(((lse.double() - lse_ref).abs()[finite] <= tol_lse[finite]).all()), "lse outside its bound"
    excess = (out.double() - out_ref).abs() - tol_out
    assert bool((excess <= 0).all()), f"out exceeds its bound by {excess.max().item():.3g}"

    # The per-rank kernel is the same arithmetic: its bf16 partials, summed in fp32 in rank
    # order and rounded once, are the merged output bit for bit, with the same L.
    total = torch.zeros(tokens, heads, dim)
    for r in range(ranks):
        with poisoned_outputs():
            scaled, lse_r = dcp_lse_correct(outs[r].to(DEVICE), lses.to(DEVICE), rank=r)
        assert_same_bits(lse_r, lse)
        total += scaled.cpu().float()
    assert_same_bits(total.to(torch.bfloat16), out)


@_IGNORE_NUMPY_WARNINGS
def test_triton_dcp_merge_single_rank_is_identity():
    # N = 1: L = lse exactly, f = exp(0) = 1, so the merge returns the rank's output bit for bit.
    gen = torch.Generator().manual_seed(7)
    outs = torch.randn(1, 3, 5, 64, generator=gen).to(torch.bfloat16)
    lses = torch.randn(1, 3, 5, generator=gen) * 10
    out, lse = dcp_merge(outs.to(DEVICE), lses.to(DEVICE))
    assert_same_bits(out, outs[0])
    assert_same_bits(lse, lses[0])


def test_triton_dcp_merge_and_dcp_lse_correct_refuse_bad_inputs_before_launch(no_launch):
    outs, lses = torch.ones(2, 3, 4, 64, dtype=torch.bfloat16), torch.ones(2, 3, 4)
    merge = dict(outs=outs, lses=lses)
    _expect_refusal(dcp_merge, merge, dict(lses=lses.double()), "lses: expected dtype float32, got float64")
    _expect_refusal(dcp_merge, merge, dict(lses=torch.ones(2, 3, 5)), r"lses: expected shape \(2, 3, 4\)")
    _expect_refusal(dcp_merge, merge, dict(outs=outs.float()), "outs: expected dtype bfloat16")
    correct = dict(out_r=outs[0], lses=lses, rank=1)
    _expect_refusal(dcp_lse_correct, correct, dict(rank=2), r"rank=2 is outside \[0, N=2\)")
    _expect_refusal(dcp_lse_correct, correct, dict(out_r=outs[0, :2]), r"out_r: expected shape \(3, 4, '\*'\)")
