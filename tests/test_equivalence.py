"""The oracle's own behaviour: metrics on known inputs, the NaN/inf rules, bounds lookups, case
round trips, and crash isolation."""

import json

import pytest
import torch

from mla_verify.equivalence.judge import metrics as M
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.blocks import Judging
from tests.isolated import judged
from mla_verify.equivalence.judge.oracle import judge
from mla_verify.equivalence.judge.policy import DEVIATIONS, EXACT, LSE, OUT, bounds_for
from mla_verify.equivalence.cases.numerics import Numerics
from mla_verify.fuzz import casefile


def test_exact_metrics_count_bit_differences_including_nan_payloads():
    a = torch.tensor([1.0, float("nan"), 0.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0, float("nan"), -0.0], dtype=torch.bfloat16)
    m = M.exact(a, b)
    assert m.mismatch_frac == pytest.approx(1 / 3) and m.max_abs_at == (2,)
    assert M.exact(a.clone(), a).mismatch_frac == 0.0
    assert M.exact(torch.tensor([1, 2]), torch.tensor([1, 2, 3])).mismatch_frac == 1.0


def test_output_metrics_in_bf16_units():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 8, 512, generator=g, dtype=torch.float64)
    rounded = M.output(ref.to(torch.bfloat16), ref, 4.0)
    assert rounded.bf16_units == pytest.approx(1.0) and rounded.elem_bf16_units <= 1.0
    assert abs(rounded.mean_err) < 1e-4  # round to nearest: unbiased
    biased = M.output((ref * (1 + 2**-7)).to(torch.bfloat16), ref, 4.0)
    assert biased.bf16_units > 3 and biased.mean_err == pytest.approx(2**-7, rel=0.05)
    shifted = ref.clone()
    shifted[3, 2, 7] += 1.0
    m = M.output(shifted, ref, 4.0)
    assert m.max_abs == pytest.approx(1.0) and m.max_abs_at == (3, 2, 7) and m.mismatch_frac > 0
    assert m.elem_bf16_units > 4.0  # +1 on a row whose largest is ~3: ~85 bf16 steps of its magnitude


def test_rows_below_the_smallest_normal_float32_may_flush_to_zero():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(3, 512, generator=g, dtype=torch.float64)
    ref[1] *= 1e-39  # a sink 90 nats above every logit scales the row out of float32's normal range
    flushed = ref.to(torch.bfloat16)
    flushed[1] = 0.0  # what an FTZ fp32 kernel writes
    m = M.output(flushed, ref, 4.0)
    assert m.elem_bf16_units < 1.0 and abs(m.mean_err) < 1e-3
    lost = flushed.clone()
    lost[2] = 0.0  # the same at a normal magnitude is a lost row
    m = M.output(lost, ref, 4.0)
    assert m.elem_bf16_units >= 255 and m.max_abs_at[0] == 2
    # A weight below 2**-126 flushes before it multiplies V: with |V| ~ 7000 the row can be normal.
    ref[1] *= 1e4
    assert M.output(flushed, ref, 4.0).elem_bf16_units > 255
    value_max = torch.full((3,), 7168.0, dtype=torch.float64)
    assert M.output(flushed, ref, 4.0, value_max).elem_bf16_units < 1.0


def test_lse_units_scale_with_the_logit_scale():
    ref = torch.tensor([[10.0, 2.0]], dtype=torch.float64)
    l1 = torch.tensor([[100.0, 0.0]], dtype=torch.float64)
    err = torch.tensor([[1e-4, 0.0]], dtype=torch.float64)
    m = M.lse(ref + err, ref, l1)
    assert m.lse_fp32_units == pytest.approx(1e-4 / (2**-24 * 111))


@pytest.mark.parametrize("impl, ref, what", [
    ([1.0, float("inf")], [1.0, float("-inf")], "inf_mismatch"),
    ([1.0, float("nan")], [1.0, 2.0], "inf_mismatch"),
    ([float("nan"), 1.0], [float("nan"), 1.0], None),
])
def test_inf_and_nan_patterns_must_match_exactly(impl, ref, what):
    v = judge(LSE, torch.tensor(impl, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64), Numerics())
    if what is None:
        assert v.passed
    else:
        assert not v.passed and v.gate_metric == what


def test_nan_never_passes_whatever_the_bound():
    ref = torch.zeros(4, 512, dtype=torch.float64) + 1
    impl = ref.clone()
    impl[0, 0] = float("nan")
    v = judge(OUT, impl, ref, Numerics(scale_rule="raw"), deviations=("bf16_cache_scale",))
    assert not v.passed and v.metrics.nan_count == 1


def test_deviation_bounds_apply_only_where_their_condition_holds():
    pow2, dev = bounds_for(OUT, Numerics(scale_rule="pow2"), ["bf16_cache_scale"])
    raw, dev_raw = bounds_for(OUT, Numerics(scale_rule="raw"), ["bf16_cache_scale"])
    assert dev == "" and dev_raw == "bf16_cache_scale"
    assert raw == DEVIATIONS["bf16_cache_scale"].bounds[OUT] and pow2 != raw
    assert bounds_for(EXACT, Numerics(), ["bf16_cache_scale"])[0][0].limit == 0.0
    dcp = dict(bounds_for(OUT, Numerics(dcp_size=4), [])[0][0].__dict__)
    assert dcp["limit"] > bounds_for(OUT, Numerics(), [])[0][0].limit


def test_case_and_case_file_round_trip(tmp_path):
    case = Case("sparse_prefill", {"tokens": 2, "heads": 8, "kv_rows": 40, "topk": 128, "value_regime": "normal",
                                   "sm_scale": 0.1, "invalid": ["scattered"]}, 7)
    assert Case.from_dict(json.loads(case.dumps())) == case and len(case.case_id) == 12
    saved = [{"tensor": "out", "metric": "bf16_units", "value": 9.0, "bound": 6.0, "reason": "..."}]
    path = casefile.save(tmp_path / "f" / "c.json", casefile.CaseFile(case, ("triton",), "cuda", saved))
    back = casefile.load(path)
    assert back.case == case and back.impl == ("triton",) and back.device == "cuda"
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not an mla-verify case file"):
        casefile.load(tmp_path / "bad.json")


@pytest.mark.parametrize("impl, metric, what", [("segfaults", "crashed", "SIGSEGV"), ("exits", "crashed", "exit code 3"),
                                               ("hangs", "hung", "no answer within 3 s")])
def test_a_crashing_or_hanging_implementation_fails_its_case_and_the_worker_is_replaced(impl, metric, what):
    # 3 s: a fresh worker's start-up (seconds on a loaded CPU) is not counted against the next case.
    worker = Judging("cpu", isolate=True, timeout=20.0 if impl != "hangs" else 3.0)
    try:
        case = Case("quantize_fp8_ds_mla", {"n": 2, "value_regime": "normal", "scale_rule": "pow2"}, 1)
        rows = judged(worker, case, [f"tests.impls.misbehaving:{impl}"], impl)
        assert len(rows) == 1 and not rows[0].passed and rows[0].gate_metric == metric
        assert what in rows[0].reason
        after = judged(worker, case, ["mla_verify.reference:quantize_fp8_ds_mla"], "reference")  # a fresh worker goes on
        assert after and all(r.passed for r in after) and worker.worker.restarts == 1
    finally:
        worker.close()


@pytest.mark.parametrize("nbytes", [13, 14, 20, 24], ids=lambda n: f"{n}B")
def test_snapshot_catches_every_single_byte_change(nbytes):
    """Inputs are compared as the widest words that tile their storage: one changed byte anywhere
    (inside the view or in the padding around it), by any amount, is still a changed input."""
    from mla_verify.equivalence.sandbox.call_guards import Snapshot

    storage = torch.arange(nbytes, dtype=torch.uint8)
    view = storage[1:-1]  # bytes outside the view count too
    for at in range(nbytes):
        for delta in (1, 128):
            saved = Snapshot({"x": view, "scale": 0.5})
            storage[at] += delta
            found = saved.changed()
            storage[at] -= delta
            assert [name for name, _ in found] == ["x"], (at, delta)
            assert ("outside the tensor's view" in found[0][1]) == (at in (0, nbytes - 1))
    assert Snapshot({"x": view}).changed() == [] and Snapshot({"x": view}).changed(("x",)) == []


def test_every_deviation_a_registered_implementation_declares_is_in_the_policy():
    """optimized/ cannot import the policy (one-way layering), so a misspelled deviation on a
    registry entry would silently hold that implementation to the exact bounds: caught here."""
    from mla_verify.optimized import registry

    declared = {(stage, impl.name, d) for stage in registry.stages() for impl in registry.implementations(stage)
                for d in impl.deviations}
    assert declared, "no registered implementation declares a deviation: the registry did not load"
    assert not [entry for entry in declared if entry[2] not in DEVIATIONS]
