"""The CPU gate's bounded cost (issue 29): interpreted Triton campaigns draw only cases the
interpreter runs within the profile's budget a case, still pose every kind of problem, and a run
says how far it is. Nothing here is timed: the cases are drawn, not run."""

import io

import pytest

from mla_verify.equivalence import catalog
from mla_verify.equivalence.cases import cost
from mla_verify.equivalence.cases.params import ForwardParams, PrefillParams
from mla_verify.equivalence.cases.profiles import get_profile
from mla_verify.fuzz.campaign import Campaign, UnderTest, each, fuzz
from mla_verify.runs.progress import Progress

CI = get_profile("ci")


def drawn(op, impl, examples, seed=1, profile=CI):
    """The cases a gate campaign of `op` on `impl` draws on CPU (each passes, so none shrinks)."""
    cases = []
    fuzz(Campaign(op, profile, examples, seed, UnderTest((impl,))), each(lambda case, source: cases.append(case) or []))
    spec = catalog.get_spec(op)
    return [(c, spec.interpreted_s(spec.params_of(c.params))) for c in cases]


@pytest.mark.parametrize("op", ["sparse_prefill", "sparse_decode_fp8", "property:batch_invariance",
                                "property:padding_and_order", "property:hisparse_equals_plain"])
def test_interpreted_campaigns_draw_within_the_budget(op):
    """12 cases, or the whole covering set where it is larger (its routing pairs), each within the
    budget; the pairs within `pair_s` a case."""
    cases = drawn(op, "triton", 12)
    assert len(cases) >= 12 and max(s for _, s in cases) <= CI.interpreter_s
    if len(cases) > 12:  # the covering set ran whole: its pairs' cases within ci's pair budget
        spec = catalog.get_spec(op)
        assert min(s for _, s in cases) <= CI.pair_s


def test_hisparse_against_plain_still_draws_fp8_cases_with_a_long_prefill_under_the_budget():
    """The budget fits the FP8 draw (fewer layers and prefills) instead of dropping it."""
    fp8 = [c for c, _ in drawn("property:hisparse_equals_plain", "triton", 20, seed=3)
           if c.params["cache_dtype"] == "fp8_ds_mla"]
    assert fp8 and any(max(c.params["query_lens"]) > 128 for c in fp8)


def test_compiled_and_eager_campaigns_are_not_held_to_the_interpreters_budget():
    """torch-fp32 on CPU draws what it always did: cases over the interpreter budget among them
    (seed 3 drew a 4-layer HiSparse case the interpreter would take ~2 min on)."""
    assert max(s for _, s in drawn("property:hisparse_equals_plain", "torch-fp32", 3, seed=3)) > CI.interpreter_s


def test_the_estimate_counts_programs_and_loop_trips():
    one = cost.interpreted_s(PrefillParams(tokens=4, heads=16, kv_rows=300, topk=128, value_regime="normal",
                                           sm_scale=0.1))
    assert cost.interpreted_s(PrefillParams(tokens=8, heads=16, kv_rows=300, topk=128, value_regime="normal",
                                            sm_scale=0.1)) == pytest.approx(2 * one)
    # 64 heads are one head block, as 16 are; twice the key blocks cost more, not twice (the program's own cost)
    assert cost.interpreted_s(PrefillParams(tokens=4, heads=64, kv_rows=300, topk=128, value_regime="normal",
                                            sm_scale=0.1)) == pytest.approx(one)
    wider = cost.interpreted_s(PrefillParams(tokens=4, heads=16, kv_rows=300, topk=256, value_regime="normal",
                                             sm_scale=0.1))
    assert one < wider < 2 * one


def test_a_forward_batch_costs_its_decodes_and_prefills_and_each_hisparse_layer():
    base = dict(cache_dtype="fp8_ds_mla", heads=32, query_lens=(1, 1, 140), context_lens=(10, 20, 30), block_size=64,
                topk=128, sm_scale=0.1, value_regime="normal")
    kernels = [c.kernel for c in cost.calls(ForwardParams(**base))]
    assert kernels == ["sparse_decode_fp8", "sparse_prefill"]
    one = cost.interpreted_s(ForwardParams(**base, hisparse=True, layers=1))
    assert cost.interpreted_s(ForwardParams(**base, hisparse=True, layers=3)) == pytest.approx(3 * one)


def test_progress_says_cases_of_total_failing_elapsed_and_time_left():
    out = io.StringIO()
    p = Progress("gate", 10, every_s=0.0, stream=out)
    p.step()
    p.step(failed=True, now_at="property:determinism / triton")
    line = out.getvalue().splitlines()[-1]
    assert line.startswith("  [gate] 2/10 cases, 1 failing, ")
    assert "s elapsed, ~" in line and line.endswith("s left; property:determinism / triton")
