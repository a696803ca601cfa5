"""Input layouts at op level (equivalence.cases.layouts): each op's inputs in every layout its contract
allows hold the same values, show the layout in their strides and offsets, pass every
implementation here, and catch a kernel assuming them dense; a saved case without a layout builds
as before."""

import pytest
import torch

from mla_verify.describe import describe_op
from mla_verify.equivalence.coverage import sets as coverage
from mla_verify.equivalence.cases import layouts
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.catalog import evaluate, get_spec, inputs, resolve_subject
from mla_verify.equivalence.cases.profiles import get_profile

LAID_OUT = sorted(set(layouts.ALLOWED) - {"sparse_prefill", "sparse_decode_fp8"})  # those two: tests/test_coverage.py


def _first(op: str, layout: str) -> Case:
    """The first case of `op`'s covering set at seed 3 (ci), in `layout`."""
    case = coverage.covering_set(op, get_profile("ci"), 3)[0]
    return Case(op, {**case.params, "layout": layout}, case.seed)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("op", LAID_OUT)
def test_each_layout_holds_the_same_values_and_shows_in_the_strides(op):
    base = _first(op, "contiguous")
    plain = inputs(op, base.params, base.seed)
    for layout in layouts.drawn(op)[1:]:
        kw = inputs(op, {**base.params, "layout": layout}, base.seed)
        for name, t in plain.items():
            if isinstance(t, torch.Tensor):  # NaN poison compared as bytes
                assert kw[name].shape == t.shape and _bytes(kw[name]) == _bytes(t), (op, layout, name)
        assert layouts.FEATURES[layout] in layouts.shown(op, kw), (op, layout)
        moved = {name for name, kinds in layouts.ALLOWED[op].items() if layout in kinds}
        for name, t in kw.items():  # only the inputs the contract lets take it
            if isinstance(t, torch.Tensor) and name not in moved:
                assert t is not None and t.stride() == plain[name].stride(), (op, layout, name)


@pytest.mark.parametrize("op", LAID_OUT)
def test_a_case_saved_without_a_layout_builds_as_before(op):
    """Params from before layouts (no `layout` field) take the contiguous layout: every input as its
    case builds it, none moved to another allocation."""
    params = {k: v for k, v in _first(op, "contiguous").params.items() if k != "layout"}
    assert get_spec(op).params_of(params).layout == "contiguous"
    kw = inputs(op, params, 5)
    for name, t in kw.items():
        if isinstance(t, torch.Tensor) and name not in layouts.BUILT.get(op, {}):
            assert t.is_contiguous() and t.storage_offset() == 0, (op, name)


@pytest.mark.parametrize("op", LAID_OUT)
def test_every_implementation_here_passes_every_layout(op):
    spec = get_spec(op)
    for label, specs in spec.subjects("cpu").items():
        subject = resolve_subject(op, list(specs), "cpu")
        for layout in layouts.drawn(op):
            rows = evaluate(_first(op, layout), subject, "cpu")
            assert rows and all(r.passed for r in rows), (op, label, layout, [r.reason for r in rows if not r.passed])


def test_a_converter_reading_the_block_table_dense_is_caught_by_the_layouts_alone():
    subject = resolve_subject("convert_index", ["tests.zoo.indices:assumes_dense_block_table"], "cpu")
    for case in coverage.covering_set("convert_index", get_profile("ci"), 3):
        verdicts = {}
        for layout in layouts.drawn("convert_index"):
            rows = evaluate(Case("convert_index", {**case.params, "layout": layout}, case.seed), subject, "cpu")
            verdicts[layout] = bool(rows) and all(r.passed for r in rows)
        assert verdicts["contiguous"] and not verdicts["offset"], verdicts
        assert verdicts["padded"] == (case.params["requests"] == 1 and not case.params["mapping"]), verdicts


def test_list_says_which_inputs_must_be_contiguous():
    text = " ".join(" ".join(describe_op("convert_index")).split())
    assert "block_table (padded, offset)" in text
    assert "must be contiguous, drawn at a storage offset too: req_id, idx_mapping, prefill_request_ids" in text
    text = " ".join(" ".join(describe_op("sparse_prefill")).split())
    assert "must be contiguous: topk_length, attn_sink" in text
    assert "kv_cache: blocks at a drawn stride" in " ".join(" ".join(describe_op("write_fp8_ds_mla_cache")).split())
