"""Red zones (optimized.buffers): guard bytes before and after every buffer allocated during a
checked call, compared as bytes after it; an out-of-bounds write fails the case."""

import math

import torch

from mla_verify.equivalence.catalog import evaluate, resolve_subject
from mla_verify.equivalence.cases.case import Case
from mla_verify.optimized import buffers


def test_a_write_past_either_end_is_breached():
    with buffers.poisoned(), buffers.red_zones() as zones:
        clean = buffers.empty((3, 5), torch.float32, "cpu")
        before = buffers.empty((7,), torch.float32, "cpu")
        after = buffers.empty((2, 2), torch.bfloat16, "cpu")
        clean.fill_(1.0)
        torch.as_strided(before, (1,), (1,), before.storage_offset() - 1).fill_(math.nan)  # a NaN is a change too
        torch.as_strided(after, (1,), (1,), after.storage_offset() + after.numel()).fill_(0.0)
        found = buffers.breached(zones)
    assert len(found) == 2 and "4 guard bytes before and 0 after a 28-byte buffer" in found[0]
    assert "0 guard bytes before and 2 after a 8-byte buffer" in found[1]
    assert bool(clean.eq(1.0).all()) and buffers.breached(zones[:1]) == []


def test_outside_the_harness_buffers_are_plain():
    t = buffers.empty((4,), torch.float32, "cpu")
    assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == 16


def test_an_out_of_bounds_write_fails_the_case():
    """The self-test: a kernel whose output is right but which writes one element past it."""
    case = Case("concat_mla_q", {"tokens": 3, "heads": 2}, 1)
    rows = evaluate(case, resolve_subject("concat_mla_q", ["tests.zoo.layout:writes_past_the_end"], "cpu"), "cpu")
    assert rows and not any(r.passed for r in rows)
    assert any("red zones" in r.reason and "2 after" in r.reason for r in rows)
    good = evaluate(case, resolve_subject("concat_mla_q", [], "cpu"), "cpu")
    assert good and all(r.passed for r in good)
