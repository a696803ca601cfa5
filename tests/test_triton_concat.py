"""Our Triton MLA query concat (concat_mla_q) against the reference, bit for bit on every layout,
and its refusal of bad inputs before any launch.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from mla_verify import reference as R
from mla_verify.optimized.kernels.concat import concat_mla_q
from tests.triton_glue_helpers import (  # noqa: F401  (no_launch: a fixture)
    DEVICE, _expect_refusal, _gen, assert_same_bits, no_launch, poisoned_outputs, seeds,
)


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 8), heads=st.integers(1, 20), layout=st.sampled_from(["packed", "sliced", "transposed"]), seed=seeds)
def test_triton_concat_mla_q_matches_reference(tokens, heads, layout, seed):
    gen = _gen(seed)

    def bits(*shape):  # arbitrary bf16 bit patterns, NaN payloads included
        return torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)

    # Each layout: base tensors, and how to cut ql_nope and q_pe out of them (cut on each device,
    # since moving a view between devices packs it).
    if layout == "packed":
        bases, cut = (bits(tokens, heads, 512), bits(tokens, heads, 64)), lambda a, b: (a, b)
    elif layout == "sliced":  # the halves of a wider projection output
        bases, cut = (bits(tokens, heads, 700),), lambda w: (w[:, :, 100:612], w[:, :, 620:684])
    else:
        bases = (bits(heads, tokens, 512), bits(heads, 64, tokens))
        cut = lambda a, b: (a.transpose(0, 1), b.permute(2, 0, 1))  # noqa: E731
    with poisoned_outputs():
        got = concat_mla_q(*cut(*(b.to(DEVICE) for b in bases)))
    assert_same_bits(got, R.concat_mla_q(*cut(*bases)))


def test_triton_concat_mla_q_refuses_bad_inputs_before_launch(no_launch):
    base = dict(ql_nope=torch.ones(2, 3, 512, dtype=torch.bfloat16), q_pe=torch.ones(2, 3, 64, dtype=torch.bfloat16))
    _expect_refusal(concat_mla_q, base, dict(q_pe=torch.ones(2, 3, 32, dtype=torch.bfloat16)), r"q_pe: expected shape \(2, 3, 64\)")
    _expect_refusal(concat_mla_q, base, dict(q_pe=torch.ones(1, 3, 64, dtype=torch.bfloat16)), r"q_pe: expected shape \(2, 3, 64\)")
    _expect_refusal(concat_mla_q, base, dict(ql_nope=torch.ones(2, 3, 512)), "ql_nope: expected dtype bfloat16")
