"""Where it went wrong (issue 38): the first pipeline stage whose output differs from the
reference's stage on the same inputs, and the requests, heads, tiles and tokens a failing
tensor's error is confined to; never a pattern read into the noise of a correct implementation."""

import re

import pytest
import torch

from mla_verify.equivalence.judge import localize, mismatch
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.catalog import evaluate, get_spec, resolve_subject
from mla_verify.equivalence.judge.policy import EXACT, bounds_for
from mla_verify.equivalence.cases.profiles import get_profile
from mla_verify.fuzz.campaign import Campaign, each, fuzz
from mla_verify.fuzz.regressions import corpus

FIRST_BASE = "convert_index=tests.zoo.indices:first_request_base"
BASE = dict(arch="sm90", block_size=64, dcp_size=1, interleave=1, invalid=[], max_decode_query_len=1, mqa="all",
            q_form="tensor", scale_rule="pow2", shuffle=True, sm_scale=0.1352, spare_blocks=1, stride_pad=0,
            table_pad=0, topk=128, value_regime="normal", workspace_size=None, context_lens=[40, 70, 9],
            max_model_len=80)
PATHS = {  # three requests; on fp8_separate request 0 is a decode, 1-2 prefills
    "bf16": dict(cache_dtype="bfloat16", heads=16, query_lens=[1, 1, 1]),
    "fp8_mixed": dict(cache_dtype="fp8_ds_mla", heads=16, query_lens=[1, 1, 1]),
    "fp8_separate": dict(cache_dtype="fp8_ds_mla", heads=32, query_lens=[1, 3, 4]),
}
FIRST = "stage convert_index is the first whose output differs from the reference's on the same inputs"


def _rows(case: Case, impl: str) -> dict:
    return {r.tensor: r for r in evaluate(case, resolve_subject(case.op, [impl], "cpu"), "cpu")}


@pytest.mark.parametrize("path", PATHS)
def test_a_converter_wrong_past_the_first_request_is_named_on_every_path_that_uses_it(path):
    rows = _rows(Case("forward_mqa", {**BASE, **PATHS[path]}, 1), FIRST_BASE)
    assert rows["out"].path == path
    for tensor in ("out", "lse"):
        reason = rows[tensor].reason
        assert not rows[tensor].passed and FIRST in reason, reason
        assert "fed the reference's stage outputs, every other stage matches" in reason
    stage = rows["out"].reason.split(FIRST)[1]
    # the stage's own mismatch line, and where in it: the tokens of the later requests
    assert re.search(r"indices: mismatch_frac = [\d.]+ > 0: \d+ / \d+ elements .* differ bit for bit; first at", stage)
    if path == "fp8_separate":  # request 1, the first prefill, reads its own start: right by accident
        assert "all 128 differing rows belong to prefill request 2 of 3; requests 0-1 match" in rows["out"].reason
        assert "first at [4,0]" in stage  # token 4: request 2's first
    else:
        assert "all 32 differing rows belong to requests 1-2 of 3; request 0 matches" in rows["out"].reason
        assert "differing elements belong to requests 1-2 of 3; request 0 matches" in stage


def test_a_dcp_converter_is_named_with_its_rank():
    case = Case("forward_mqa", {**BASE, **PATHS["fp8_mixed"], "dcp_size": 2, "interleave": 2}, 3)
    rows = _rows(case, "dcp_convert_index=tests.zoo.indices:dcp_interleave_ignored")
    assert rows["out"].path == "fp8_mixed_dcp"
    reason = rows["out"].reason
    assert "stage dcp_convert_index (rank 0) is the first whose output differs" in reason, reason
    assert "ranks 0, 1 differ there" in reason


def test_fed_the_reference_outputs_a_second_fault_is_named_too():
    impls = [FIRST_BASE, "sparse_decode_fp8=tests.zoo.attention:decode_e8m0_scales"]
    case = Case("forward_mqa", {**BASE, **PATHS["fp8_mixed"], "scale_rule": "raw"}, 1)
    rows = {r.tensor: r for r in evaluate(case, resolve_subject("forward_mqa", impls, "cpu"), "cpu")}
    reason = rows["out"].reason
    assert FIRST in reason and "fed the reference's stage outputs, stage sparse_decode_fp8 differs too: out:" in reason


def test_a_passing_case_is_not_traced():
    rows = _rows(Case("forward_mqa", {**BASE, **PATHS["bf16"]}, 1), "convert_index=torch-fp32")
    assert all(r.passed and "stage" not in r.reason for r in rows.values())


def test_a_decode_kernel_with_its_scale_tiles_swapped_names_the_tiles():
    case = Case("sparse_decode_fp8", {"batch": 2, "heads": 16, "invalid": [], "page_size": 64, "s_q": 1,
                                      "scale_rule": "pow2", "seq_lens": [100, 40], "sm_scale": 0.0417, "stride_pad": 0,
                                      "topk": 64, "value_regime": "outliers"}, 2)
    rows = _rows(case, "tests.zoo.attention:decode_scale_tiles_swapped")
    assert not rows["out"].passed and rows["lse"].passed
    assert "errors in columns 256-511 only (scale tiles 2, 3)" in rows["out"].reason, rows["out"].reason


def test_claims_name_the_contract_axes():
    axes = localize.Axes(("B", "S", "H", "512"))
    differ = torch.zeros(4, 2, 16, 512, dtype=torch.bool)
    differ[1:, :, :, 384:] = True
    assert localize.where(axes, differ, exact=False) == \
        "only batch entries >= 1; errors in columns 384-511 only (scale tile 3)"
    lengths = localize.Axes(("T", "K"), lengths=torch.tensor([0, 5, 0, 7, 3, 0]))
    one = torch.zeros(6, 8, dtype=torch.bool)
    one[[0, 2, 5], 0] = True
    assert localize.where(lengths, one, exact=True) == "only tokens with topk_length 0"
    assert localize.dims_of("forward_mqa", "lse") == ("T", "H")
    assert localize.dims_of("convert_index", "valid_counts", ["indices", "valid_counts"]) == ("T",)


def test_a_few_scattered_float_differences_are_no_pattern():
    axes = localize.Axes(("T", "H", "512"), requests=torch.tensor([0, 0, 1, 1]))
    differ = torch.zeros(4, 8, 512, dtype=torch.bool)
    differ[2, 3, 400] = differ[3, 1, 390] = differ[2, 0, 500] = True  # 3 rows, one request, one tile
    assert localize.where(axes, differ, exact=False) == ""
    assert localize.where(axes, differ, exact=True).startswith("all 3 differing rows belong to request 1 of 2")


FLOAT_OPS = ("forward_mqa", "sparse_prefill", "sparse_decode_fp8", "dcp_merge")
RESEEDS, DRAWS = 2, 6


def _noise_lines(case: Case, counts: dict) -> list:
    """Each float tensor of the correct implementation's answer, its 1% of elements nearest their
    allowed difference taken as differing (what a bound drawn a little too tight would fail):
    the pattern lines they would print."""
    spec = get_spec(case.op)
    params = spec.params_of(case.params)
    kwargs = spec.inputs(params, case.seed, "cpu")
    got = spec.call(spec.subject([], "cpu"), kwargs, params).tensors
    want = spec.reference(spec.inputs(params, case.seed, "cpu"), params)
    lines = []
    for check in spec.checks:
        if check.kind == EXACT or check.tensor not in got or check.tensor not in want:
            continue
        bounds, _ = bounds_for(check.kind, params.numerics().replace(dcp_size=1) if check.single_rank
                               else params.numerics())
        pair = mismatch.Pair(check.tensor, got[check.tensor], want[check.tensor], want.get(check.scale))
        impl, ref = pair.impl.double(), pair.ref.double()
        both = torch.isfinite(impl) & torch.isfinite(ref)
        allowed = mismatch.allowed_of(check.kind, ref, both, bounds, pair)
        if allowed is None:
            continue
        ratio = torch.where(both & (allowed > 0), (impl - ref).abs() / allowed, 0.0)
        differ = (ratio > 0) & (ratio >= ratio.flatten().quantile(0.99)) if ratio.numel() else ratio > 0
        counts["tensors"] += 1
        counts["with_differences"] += bool(differ.any())
        line = localize.where(spec.axes(check.tensor, kwargs), differ, exact=False, live=(impl != ref) | (ref != 0),
                              magnitude=torch.where(both, ref, 0.0).abs(),
                              error=torch.where(both, impl - ref, 0.0).abs())
        if line:
            lines.append(f"{case.short()} {check.tensor}: {line}")
    return lines


def test_the_correct_implementations_print_no_pattern_over_the_gates_cases_reseeded():
    """The gate's cases (its corpus reseeded, then a ci campaign: the op's covering set, then
    draws) through the implementations the CPU gate defaults to: no pattern line from the elements
    nearest their bounds. forward_mqa draws without its covering set: its 37 cases pose the
    attention kernels whose covering sets run here (production heads and top-k, flat rows) along
    its paths, and were two thirds of the test's time (56 s in a CI run before)."""
    counts, lines, cases = {"tensors": 0, "with_differences": 0}, [], 0
    for op in FLOAT_OPS:
        pinned = [Case(c.op, c.params, c.seed + k) for c, _ in corpus(op) for k in range(1, RESEEDS + 1)]

        def run(case, source):
            lines.extend(_noise_lines(case, counts))
            return []

        for case in pinned:
            run(case, "corpus")
        drawn = fuzz(Campaign(op, get_profile("ci"), DRAWS, 38, shrink=False, covering=op != "forward_mqa"), each(run))
        cases += len(pinned) + drawn.examples
    print(f"{cases} cases, {counts['tensors']} float tensors, {counts['with_differences']} with differences taken"
          f", {len(lines)} pattern lines")
    assert counts["with_differences"] >= 5, counts  # the noise is there to be misread
    assert not lines, lines


def test_a_nan_read_names_the_invalid_entries_that_point_at_poisoned_rows():
    case = Case("sparse_prefill", {"tokens": 4, "heads": 2, "kv_rows": 2000, "topk": 128, "value_regime": "normal",
                                   "sm_scale": 0.1, "invalid": ["scattered"], "topk_length": "none", "sink": "none"}, 5)
    rows = _rows(case, "tests.zoo.attention:minus_one_reads_row_0")
    out = rows["out"]
    assert not out.passed and out.gate_metric == "inf_mismatch", out.reason
    found = re.search(r"token (\d+)'s position (\d+) holds -1, read as kv row 0, which no valid entry selects \(NaN\)",
                      out.reason)
    assert found, out.reason
    spec = get_spec("sparse_prefill")
    kw = spec.inputs(spec.params_of(case.params), case.seed, "cpu")
    t, j = map(int, found.groups())
    assert int(kw["indices"][t, j]) == -1 and bool(torch.isnan(kw["kv"][0]).all())


def test_a_decode_nan_read_names_the_minus_one_entry_read_as_slot_0():
    case = Case("sparse_decode_fp8", {"batch": 2, "heads": 16, "invalid": ["scattered"], "page_size": 64, "s_q": 1,
                                      "scale_rule": "pow2", "seq_lens": [100, 40], "sm_scale": 0.0417, "stride_pad": 0,
                                      "topk": 64, "value_regime": "normal"}, 3)  # slot 0 is never written
    out = _rows(case, "tests.zoo.attention:decode_minus_one_reads_slot_0")["out"]
    assert not out.passed and re.search(r"batch entry \d's position \d+ holds -1, read as slot 0, which no valid entry "
                                        r"selects \(NaN\): the kernel reads invalid entries", out.reason), out.reason


def test_list_op_forward_mqa_lists_its_stages_with_their_contracts():
    from mla_verify.describe import describe

    text = "\n".join(describe("forward_mqa"))
    assert "q=bfloat16[T=" in text and "topk_indices=int32[T=" in text and "block_table=int32[R=" in text
    assert "    bf16: convert_index -> sparse_prefill" in text
    assert "    fp8_mixed_dcp: dcp_convert_index -> sparse_decode_fp8 -> dcp_merge" in text
    assert "    convert_index(req_id[T] int32, block_table[R,M] int32, topk_indices[T,K] int32" in text
    assert "-> (out[B,S,H,512] bf16, lse[B,H,S] f32)" in text


CALLS = {"convert": 0}


def wrong_once(**kwargs):
    """A converter wrong on its first call only (module state): the traced runs see it right."""
    from mla_verify import reference

    CALLS["convert"] += 1
    if CALLS["convert"] == 1:
        kwargs["req_id"] = torch.zeros_like(kwargs["req_id"])
    return reference.convert_index(**kwargs)


def test_a_failure_no_stage_repeats_says_every_stage_matches():
    CALLS["convert"] = 0
    rows = _rows(Case("forward_mqa", {**BASE, **PATHS["bf16"]}, 1), "convert_index=tests.test_localize:wrong_once")
    assert not rows["out"].passed and CALLS["convert"] == 3  # the case, then the plain and the fed run
    assert "every stage's output matches the reference's stage on its own inputs" in rows["out"].reason


def test_isolated_the_worker_sends_the_stage_calls_and_the_parent_judges_them():
    from mla_verify.equivalence.blocks import Judging
    from tests.isolated import judged

    case = Case("forward_mqa", {**BASE, **PATHS["fp8_separate"]}, 1)
    worker = Judging("cpu", isolate=True, timeout=120)
    try:
        found = {r.tensor: r for r in judged(worker, case, [FIRST_BASE], "pipeline", source="replay")}
        unreported = {r.tensor: r for r in judged(worker, case, [FIRST_BASE], "pipeline", source="rerun")}
    finally:
        worker.close()
    assert FIRST in found["out"].reason and "prefill request 2 of 3" in found["out"].reason, found["out"].reason
    assert not unreported["out"].passed and "stage" not in unreported["out"].reason  # a re-run is not traced


def test_an_error_only_on_tokens_of_one_topk_length_says_so():
    case = Case("sparse_prefill", {"tokens": 16, "heads": 4, "kv_rows": 300, "topk": 64, "value_regime": "normal",
                                   "sm_scale": 0.1, "invalid": [], "topk_length": "edges", "sink": "none"}, 4)
    lse = _rows(case, "tests.zoo.attention:empty_row_lse_minus_inf")["lse"]
    assert not lse.passed and lse.reason.endswith("; only tokens with topk_length 0"), lse.reason
    assert "(first at [5,0] (token 5, head 0))" in lse.reason


def test_the_minimized_tile_case_still_names_the_tiles():
    """`check('sparse_decode_fp8', ...:decode_scale_tiles_swapped, seed=1)`'s minimized case: one key a
    row, so every other element equals the reference exactly (an exact match counts as matching)."""
    case = Case("sparse_decode_fp8", {"batch": 2, "heads": 1, "invalid": [], "page_size": 1, "s_q": 1,
                                      "scale_rule": "pow2", "seq_lens": [1, 1], "sm_scale": 0.0417, "stride_pad": 0,
                                      "topk": 64, "value_regime": "normal"}, 0)
    out = _rows(case, "tests.zoo.attention:decode_scale_tiles_swapped")["out"]
    assert out.reason.endswith("; errors in columns 256-511 only (scale tiles 2, 3)"), out.reason


def test_stage_calls_cross_the_wire_as_data_only():
    from mla_verify.equivalence.sandbox import wire
    from mla_verify.equivalence.judge.policy import DEVIATIONS

    t = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    call = dict(stage="convert_index", impl="mine", deviations=(), rank=None,
                kwargs={"req_id": t, "block_size": 64, "prefill_request_ids": None, "lens": [1, 2]}, result=(t, t))
    tensors: list = []
    data = wire.calls_out(([call], []), tensors)
    assert len(tensors) == 1  # one tensor, however many times a call was handed it
    (got,), fed = wire.calls_in(data, lambda i: tensors[i], DEVIATIONS)
    assert fed == [] and got["kwargs"]["lens"] == [1, 2] and got["result"] == (tensors[0], tensors[0])
    for bad in ({"x": {"__class__": "os.system"}}, {"x": {"items": [], "tuple": True, "call": 1}}):
        with pytest.raises(wire.Unreadable):
            wire.calls_in([[{**data[0][0], "kwargs": bad}], []], lambda i: tensors[i], DEVIATIONS)
    with pytest.raises(wire.Unreadable):
        wire.calls_in([[{**data[0][0], "deviations": ["made_up"]}], []], lambda i: tensors[i], DEVIATIONS)
    assert wire.calls_out(([{**call, "result": object()}], []), []) == []  # not data: nothing is sent
