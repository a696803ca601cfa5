"""The DeepSeek V4 decode step as a pipeline: the project's stages pass; a broken stage fails the
step and the stage-by-stage rerun names it."""

from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.catalog import evaluate, resolve_subject

# Two requests, one short of its window (positions 0..2 of the 128-token window), MTP tokens.
CASE = {"batch": 2, "s_q": 2, "heads": 8, "topk": 128, "extra_topk": 64, "positions": [2, 150], "block_size": 5,
        "extra_block_size": 16, "kv_format": "V4", "extra_format": "V4", "compress_ratio": 4, "lengths": "exact",
        "sm_scale": 0.1, "value_regime": "normal", "scale_rule": "pow2", "invalid": [], "sink": "finite"}


def test_the_decode_step_passes_with_the_projects_stages():
    rows = evaluate(Case("v4_decode", CASE, 3), resolve_subject("v4_decode", [], "cpu"), "cpu")
    assert rows and all(r.passed for r in rows), [r.reason for r in rows if not r.passed]
    assert dict(rows[0].stages) == {"sparse_decode_v4": "triton", "window_indices": "triton"}


def test_a_window_never_clamped_at_position_0_is_named_as_the_first_stage_that_differs():
    subject = resolve_subject("v4_decode", ["window_indices=tests.zoo.v4:window_unclamped"], "cpu")
    rows = evaluate(Case("v4_decode", CASE, 3), subject, "cpu")
    failing = [r for r in rows if not r.passed]
    assert failing
    assert "window_indices" in failing[0].reason and "is the first whose output differs" in failing[0].reason, \
        failing[0].reason
