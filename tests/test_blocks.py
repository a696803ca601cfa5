"""Fuzz blocks (issue 28): cases of one params at successive seeds, their reference computed as one
batch and their checks judged at once, are each judged as the case alone is; a block campaign
saves the single failing case, shrinks it as one, and its file replays."""

from __future__ import annotations

import json
import math

import pytest

from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.catalog import evaluate, evaluate_block, get_spec, resolve_subject
from mla_verify.equivalence.cases.profiles import get_profile
from mla_verify.equivalence.judge.rows import RowContext
from mla_verify.fuzz.campaign import Campaign, UnderTest, fuzz
from mla_verify.fuzz.findings import Findings
from mla_verify.runs.progress import Progress

DECODE = {"batch": 3, "s_q": 2, "heads": 16, "topk": 128, "seq_lens": [300, 1, 70], "page_size": 16, "stride_pad": 1,
          "value_regime": "normal", "scale_rule": "raw", "sm_scale": 0.1, "invalid": ["scattered", "whole_row"]}
PREFILL = {"tokens": 5, "heads": 16, "kv_rows": 300, "topk": 128, "value_regime": "outliers", "sm_scale": 0.1,
           "invalid": ["negatives", "out_of_range", "whole_row"], "topk_length": "random", "sink": "inf"}
KERNEL = "tests.impls.some_seeds:decode"


def _same(alone, together):
    """The rows of a case judged alone and in a block: the same checks, verdicts and reasons, and
    the same values to fp64 rounding (a batched reduction may add in another order)."""
    assert [(r.tensor, r.passed, r.gate_metric, r.deviation, r.reason) for r in alone] == \
           [(r.tensor, r.passed, r.gate_metric, r.deviation, r.reason) for r in together]
    for a, b in zip(alone, together):
        assert math.isclose(a.value, b.value, rel_tol=1e-9, abs_tol=1e-300), (a.tensor, a.value, b.value)
        assert a.case == b.case and a.seed == b.seed


@pytest.mark.parametrize("op, params, impl", [("sparse_decode_fp8", DECODE, "torch-fp32"),
                                              ("sparse_decode_fp8", DECODE, KERNEL),
                                              ("sparse_prefill", {**PREFILL, "sink": "none"}, "torch-fp32"),
                                              ("sparse_prefill", PREFILL, "torch-fp32")],
                         ids=["decode-stacked", "decode-failing-members", "prefill-stacked", "prefill-sinks-case-by-case"])
def test_a_block_judges_each_case_as_it_is_judged_alone(op, params, impl):
    subject = resolve_subject(op, [impl], "cpu")
    cases = [Case(op, params, seed) for seed in range(11, 16)]
    block = evaluate_block(cases, subject, "cpu")
    assert len(block) == len(cases)
    for case, rows in zip(cases, block):
        _same(evaluate(case, subject, "cpu"), rows)
    if impl == KERNEL:  # the block holds both outcomes, each where the case alone has it
        assert {all(r.passed for r in rows) for rows in block} == {True, False}


def test_a_kernel_returning_its_static_buffer_is_judged_on_each_call_s_own_answer():
    """A block holds every case's outputs until it judges them: each is a copy of its own, taken
    before the next call overwrites the kernel's buffer."""
    subject = resolve_subject("sparse_decode_fp8", ["tests.impls.some_seeds:static_buffer"], "cpu")
    cases = [Case("sparse_decode_fp8", DECODE, seed) for seed in range(11, 15)]
    for case, rows in zip(cases, evaluate_block(cases, subject, "cpu")):
        assert all(r.passed for r in rows), [r.reason for r in rows if not r.passed]
        _same(evaluate(case, subject, "cpu"), rows)


@pytest.mark.parametrize("op, params", [("sparse_decode_fp8", DECODE), ("sparse_prefill", {**PREFILL, "sink": "none"})],
                         ids=["decode", "prefill"])
def test_the_reference_answers_a_block_in_one_call(op, params):
    spec = get_spec(op)
    params = spec.params_of(params)
    kwargs = [spec.inputs(params, seed, "cpu") for seed in (1, 2, 3)]
    answer = spec._answer(kwargs, params)
    assert answer.stacked["out"].shape[0] == 3  # one stacked call, viewed per case
    for kw, mine in zip(kwargs, answer.cases):
        alone = spec.reference(kw, params)
        assert set(alone) == set(mine)
        for name, t in alone.items():
            assert t.shape == mine[name].shape and t.allclose(mine[name], rtol=1e-12, atol=0, equal_nan=True), name


@pytest.mark.parametrize("op, params", [("sparse_decode_fp8", DECODE), ("sparse_prefill", {**PREFILL, "sink": "none"})],
                         ids=["decode", "prefill"])
def test_a_large_block_is_answered_case_by_case_and_judged_in_chunks(op, params, monkeypatch):
    """Past STACK_BYTES the reference answers each case alone, past JUDGE_BYTES a check is judged
    a chunk of cases at a time: the memory a block holds stays bounded, its rows do not change."""
    from mla_verify.equivalence.ops import attention, base

    subject = resolve_subject(op, ["torch-fp32"], "cpu")
    cases = [Case(op, params, seed) for seed in range(11, 14)]
    together = evaluate_block(cases, subject, "cpu")
    spec = get_spec(op)
    kwargs = [spec.inputs(spec.params_of(params), c.seed, "cpu") for c in cases]
    monkeypatch.setattr(attention, "STACK_BYTES", 0)
    monkeypatch.setattr(base, "JUDGE_BYTES", 1)  # a case a chunk
    assert spec.stack(kwargs) is None and not spec._answer(kwargs, spec.params_of(params)).stacked
    for rows, apart in zip(together, evaluate_block(cases, subject, "cpu")):
        _same(apart, rows)


def test_a_call_writing_a_later_case_s_inputs_fails_that_case_and_the_reference_reads_them_as_built():
    """A block's inputs are built and snapshotted before its first call: the first call writing
    the queries of the cases after it shows on theirs, and the reference answers every case from
    the bytes as built (their kernels ran on what was written: their values fail too)."""
    from tests.impls import some_seeds

    some_seeds._SCRIBBLED.clear()
    subject = resolve_subject("sparse_decode_fp8", ["tests.impls.some_seeds:scribbles_later_queries"], "cpu")
    cases = [Case("sparse_decode_fp8", DECODE, seed) for seed in range(11, 14)]
    first, *later = evaluate_block(cases, subject, "cpu")
    assert some_seeds._SCRIBBLED and all(r.passed for r in first)
    for rows in later:
        written = [r for r in rows if r.tensor == "input:q"]
        assert written and "input written by the implementation" in written[0].reason
        assert not next(r for r in rows if r.tensor == "out").passed  # judged against the query as built


def test_a_block_campaign_saves_and_shrinks_the_one_failing_case(tmp_path):
    subject = resolve_subject("sparse_decode_fp8", [KERNEL], "cpu")
    campaign = Campaign("sparse_decode_fp8", get_profile("ci"), 40, 2, UnderTest((KERNEL,)), block=4,
                        findings=Findings(tmp_path), covering=False)  # covering cases run one at a time: drawn blocks only
    result = fuzz(campaign, lambda cs, s, on_call: evaluate_block(cs, subject, "cpu", source=s, on_call=on_call))
    assert result.failure is not None and result.shrunk and result.flaky is None
    assert result.examples % 4 == 0 or result.examples == 40  # whole blocks counted case by case
    assert len({r.case_id for r in result.rows if r.source == "fuzz"}) == result.examples
    assert list((tmp_path / "failures").iterdir()) == [result.case_file]  # one finding, one file
    minimized = json.loads(result.case_file.read_text())
    found = minimized["unshrunk"] or minimized["case"]  # None: the case as found was the smallest
    assert found["op"] == minimized["case"]["op"] == "sparse_decode_fp8"
    assert minimized["case"]["params"]["batch"] <= found["params"]["batch"]
    replayed = evaluate(Case.from_dict(minimized["case"]), subject, "cpu")
    assert not all(r.passed for r in replayed)  # the saved case fails alone, as it failed in its block


def test_blocks_count_cases_and_call_on_call_once_a_case():
    subject = resolve_subject("sparse_decode_fp8", ["torch-fp32"], "cpu")
    calls, blocks = [], []

    def run_block(cases, source, on_call):
        blocks.append(len(cases))
        return evaluate_block(cases, subject, "cpu", source=source, on_call=lambda: (calls.append(1), on_call()))

    class Told(Progress):  # hears which case starts
        def started(self, case, source):
            started.append(case.case_id)

    started = []
    result = fuzz(Campaign("sparse_decode_fp8", get_profile("ci"), 10, 1, block=4, covering=False), run_block,
                  Told("told", 10))
    assert blocks == [4, 4, 2] and result.examples == 10 and len(calls) == 10
    assert started == [c for c in dict.fromkeys(r.case_id for r in result.rows)]  # journaled in call order


def test_an_isolated_block_is_judged_in_the_parent_as_in_process():
    from mla_verify.equivalence.blocks import Judging

    subject = resolve_subject("sparse_decode_fp8", [KERNEL], "cpu")
    cases = [Case("sparse_decode_fp8", DECODE, seed) for seed in range(11, 15)]
    sent = []
    with Judging("cpu", isolate=True) as judging:
        isolated = judging.block(cases, judging.subject("sparse_decode_fp8", [KERNEL]),
                                 RowContext(label=subject.label, on_call=lambda: sent.append(1)))
    assert len(sent) == len(cases)
    for alone, rows in zip(evaluate_block(cases, subject, "cpu"), isolated):
        _same(alone, rows)


def test_an_isolated_block_with_crashed_cases_judges_the_others_against_the_answer_computed_meanwhile():
    """The parent answers the block while the worker produces it: the cases that crashed keep their
    row, and each of the others is judged against its own answer, as alone."""
    from mla_verify.equivalence.blocks import Judging

    impl = "tests.impls.some_seeds:dies_every_second_call"
    subject = resolve_subject("sparse_decode_fp8", [impl], "cpu")
    cases = [Case("sparse_decode_fp8", DECODE, seed) for seed in range(11, 15)]
    with Judging("cpu", isolate=True) as judging:
        found = judging.block(cases, judging.subject("sparse_decode_fp8", [impl]), RowContext(label=subject.label))
    for i in (1, 3):
        rows, = found[i]
        assert rows.gate_metric == "crashed" and "SIGKILL" in rows.reason
    correct = resolve_subject("sparse_decode_fp8", ["torch-fp32"], "cpu")
    for i in (0, 2):
        _same(evaluate(cases[i], correct, "cpu"), found[i])


def test_a_block_of_many_parts_is_judged_part_by_part_holding_no_earlier_part(monkeypatch):
    """Inputs past BLOCK_BYTES split a block into parts: judged from what was produced, each part's
    cases are judged as alone, and no part's inputs or answer are held while the next is answered
    (an isolated 4-part campaign on one H200 ran out of its GPU share holding them)."""
    import gc
    import weakref

    from mla_verify.equivalence.catalog import produce
    from mla_verify.equivalence.ops import base

    monkeypatch.setattr(base, "BLOCK_BYTES", 1)  # a part a case
    subject = resolve_subject("sparse_decode_fp8", ["torch-fp32"], "cpu")
    spec = get_spec("sparse_decode_fp8")
    cases = [Case("sparse_decode_fp8", DECODE, seed) for seed in range(11, 14)]
    prepared = spec.prepare_block(cases, "cpu")
    first = [weakref.ref(prepared.answer.cases[0]["out"]), weakref.ref(prepared.kwargs[0]["kv_cache"])]
    seen = []
    original = spec._answer

    def answer(kwargs, params):
        gc.collect()
        seen.append([held() is not None for held in first])
        return original(kwargs, params)

    object.__setattr__(spec, "_answer", answer)  # a frozen spec: shadowed on this instance, then removed
    try:
        context = RowContext(label=subject.label)
        found = spec.judge_produced_block(cases, [produce(c, subject, context) for c in cases], context,
                                          prepared=prepared)
    finally:
        object.__delattr__(spec, "_answer")
    assert seen == [[False, False]] * 2  # the later parts answered without the first's answer or inputs
    for case, rows in zip(cases, found):
        _same(evaluate(case, subject, "cpu"), rows)


def test_a_block_of_many_parts_evaluated_in_process_holds_no_earlier_part(monkeypatch):
    """In process too, a part's inputs, their snapshots and its answer are let go before the next
    part is built and answered; each case is judged as alone."""
    import gc
    import weakref

    from mla_verify.equivalence.ops import base

    monkeypatch.setattr(base, "BLOCK_BYTES", 1)  # a part a case
    subject = resolve_subject("sparse_decode_fp8", ["torch-fp32"], "cpu")
    spec = get_spec("sparse_decode_fp8")
    cases = [Case("sparse_decode_fp8", DECODE, seed) for seed in range(11, 14)]
    held, seen = [], []
    original = spec._answer

    def answer(kwargs, params):
        gc.collect()
        seen.append([ref() is not None for ref in held])
        found = original(kwargs, params)
        held[:] = [weakref.ref(found.cases[0]["out"]), weakref.ref(kwargs[0]["kv_cache"])]
        return found

    object.__setattr__(spec, "_answer", answer)  # a frozen spec: shadowed on this instance, then removed
    try:
        found = spec.evaluate_block(cases, subject, RowContext(label=subject.label))
    finally:
        object.__delattr__(spec, "_answer")
    assert seen == [[], [False, False], [False, False]]
    for case, rows in zip(cases, found):
        _same(evaluate(case, subject, "cpu"), rows)


def test_the_judge_answering_meanwhile_keeps_the_callers_reference_memory_limit():
    """The answer computed on the parent's other thread holds to the caller's `memory_limit` (a
    thread starts with an empty context): too small a budget fails there as in this thread."""
    from mla_verify.equivalence.blocks import Judging
    from mla_verify.reference import memory_limit

    subject = resolve_subject("sparse_decode_fp8", ["torch-fp32"], "cpu")
    with Judging("cpu", isolate=True) as judging:
        with memory_limit(1 << 16), pytest.raises(ValueError, match="holds no query token"):
            judging.block([Case("sparse_decode_fp8", DECODE, 11)], judging.subject("sparse_decode_fp8", ["torch-fp32"]),
                          RowContext(label=subject.label))


def test_a_judge_name_patched_in_a_block_fails_every_case_called_and_is_put_back(monkeypatch):
    """In process a block checks the judge's names once, after its last call: the patch of one call
    fails each case of the block (they share the implementation), and nothing judges with it."""
    import torch

    from tests.impls import some_seeds

    monkeypatch.setattr(some_seeds, "_CALLS", [])
    subject = resolve_subject("sparse_decode_fp8", ["tests.impls.some_seeds:patches_the_judge_on_its_second_call"],
                              "cpu")
    cases = [Case("sparse_decode_fp8", DECODE, seed) for seed in range(11, 15)]
    sub = torch.sub
    found = evaluate_block(cases, subject, "cpu")
    assert torch.sub is sub
    for rows in found:
        row, = rows
        assert row.gate_metric == "contract" and "replaced torch.sub in a call of a block of 4 cases" in row.reason
    assert all(r.passed for r in evaluate(cases[0], subject, "cpu"))  # its third call patches nothing
    monkeypatch.setattr(some_seeds, "_CALLS", [1])
    row, = evaluate(cases[0], subject, "cpu")  # a case alone is checked after its call, as ever
    assert row.gate_metric == "contract" and "replaced torch.sub: the functions" in row.reason and torch.sub is sub


def test_a_call_that_loses_the_device_ends_its_block_there(monkeypatch):
    """In this process a CUDA error leaves the context unusable: the block stops at that case (its
    rows are its last), the cases after it are not run and those before it not judged (None)."""
    from mla_verify.equivalence.sandbox import device as dev

    subject = resolve_subject("sparse_decode_fp8", [KERNEL], "cpu")
    cases = [Case("sparse_decode_fp8", DECODE, seed) for seed in range(11, 16)]
    calls = []

    def dies_on_the_third(**kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return subject.fn(**kwargs)

    # The context dies with the third call (patched here: the call itself may not rebind the judge's names).
    monkeypatch.setattr(dev, "usable", lambda device: len(calls) < 3)
    found = evaluate_block(cases, type(subject)(subject.label, dies_on_the_third), "cpu")
    assert len(calls) == 3 and found[0] is None and found[1] is None and found[3] is None and found[4] is None
    rows, = found[2]
    assert rows.gate_metric == "raised" and "illegal memory access" in rows.reason
