"""mla_verify.adapters and declared deviations.

On CPU the adapters wrap stand-ins with the exact native signatures of FlashMLA's and vLLM's
functions (tests/impls/upstream.py, computed by the torch-fp32 implementations): the adapted
callables must pass the oracle, map arguments and result order exactly, and a native signature
handed over unadapted must be a usage error naming its adapter. The gpu-marked tests run the real
flash_mla through the same adapters.

A user's kernel that rounds dequantized rows to bf16 (FlashMLA SM90's `bf16_dequant`) fails
raw-scale decode cases until it declares the deviation (--deviation, deviations=, or
__mla_verify_deviations__).
"""

import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mla_verify import adapters
from mla_verify.cli import main
from mla_verify.equivalence import catalog
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.catalog import evaluate, resolve_subject
from mla_verify.equivalence.cases.draws import SEEDS as seeds, decode_params
from mla_verify.equivalence.cases.profiles import get_profile
from mla_verify.equivalence.errors import UsageError
from mla_verify.equivalence.subject import check_signature
from mla_verify.equivalence.cases.values import REGIMES
from mla_verify.fuzz import casefile
from mla_verify.fuzz.campaign import Campaign, each, first_cases, fuzz, new_seed
from mla_verify.optimized import eager
from tests.impls import upstream

CI = get_profile("ci")


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def campaign(op, spec, examples=6, deviations=(), device="cpu", profile=CI):
    seed = new_seed()
    subject = resolve_subject(op, [spec], device, deviations=deviations)
    result = fuzz(Campaign(op, profile, examples, seed, shrink=False),
                  each(lambda case, source: evaluate(case, subject, device, source=source)))
    print(f"{spec} on {op}: seed {seed}")
    return seed, result


# ----------------------------------------------------------------------------- adapted stand-ins


@pytest.mark.parametrize("op, adapted", [
    ("sparse_prefill", "prefill"), ("sparse_decode_fp8", "decode"),
    ("convert_index", "convert_index"), ("dcp_convert_index", "dcp_convert_index"),
])
def test_adapted_upstream_signatures_pass_the_oracle(op, adapted):
    spec = f"tests.impls.upstream:{adapted}"
    seed, result = campaign(op, spec)
    assert result.failure is None, f"seed {seed}: {result.failure.case.short()}"
    cover = first_cases(op, CI, None, None, (spec,), "cpu", seed)  # runs whole, the draws fill the rest of 6
    assert result.examples == max(6, len(cover)) and all(r.passed for r in result.rows)
    if op.startswith("sparse"):  # heads under 64 are padded to 64 for the kernel: the rows keep the case's
        heads = {case.case_id: case.params["heads"] for case in cover}
        assert all(r.heads == heads[r.case_id] for r in result.rows if r.case_id in heads)
        assert {1, 8, 16} <= {r.heads for r in result.rows}


def _prefill_kwargs(heads: int, seed: int, topk_length: str = "random", sink: str = "finite") -> dict:
    params = dict(tokens=3, heads=heads, kv_rows=300, topk=128, value_regime="normal", sm_scale=0.1352,
                  topk_length=topk_length, sink=sink)
    return catalog.inputs("sparse_prefill", params, seed)


@pytest.mark.parametrize("heads", [64, 16])
def test_prefill_adapter_maps_shapes_padding_and_result_order(heads):
    seed = new_seed()
    kw = _prefill_kwargs(heads, seed)
    out, lse, max_logits = upstream.prefill(**kw)
    want_out, want_lse, want_max = eager.sparse_prefill(**kw)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape == max_logits.shape == (3, heads)
    if heads == 64:  # no padding: the very same computation
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse) and torch.equal(max_logits, want_max)
    else:  # padded heads go through other GEMM shapes: equal up to fp32 reassociation
        torch.testing.assert_close(out, want_out, rtol=0, atol=2**-7 * out.abs().max().item())
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(max_logits, want_max, rtol=1e-5, atol=1e-5)
    # lse and max_logits are not swapped: max_logits <= lse on every non-empty row
    finite = torch.isfinite(lse)
    assert finite.any() and (max_logits[finite] <= lse[finite] + 1e-5).all(), f"seed {seed}"


def test_padded_sink_heads_have_no_effect():
    q = torch.zeros(1, 2, 576, dtype=torch.bfloat16)
    sink = torch.tensor([0.5, -1.0])
    assert adapters.pad_heads(q, 0.0).shape == (1, 64, 576)
    padded = adapters.pad_heads(sink[:, None], -math.inf)[:, 0]
    assert padded.shape == (64,) and torch.equal(padded[:2], sink) and (padded[2:] == -math.inf).all()
    assert adapters.flash_mla_heads(65) == 128 and adapters.flash_mla_heads(200) == 200


def test_decode_adapter_reuses_one_plan_per_shape():
    params = dict(batch=2, s_q=1, heads=8, topk=64, seq_lens=[40, 70], page_size=16, value_regime="normal",
                  scale_rule="pow2", sm_scale=0.1)
    decode = adapters.flash_mla_with_kvcache(upstream.flash_mla_with_kvcache, upstream.get_mla_metadata)
    upstream.METADATA_CALLS.clear()
    for seed in (1, 2):  # same shapes: one plan, which the stand-in asserts is used consistently
        decode(**catalog.inputs("sparse_decode_fp8", params, seed))
    assert len(upstream.METADATA_CALLS) == 1
    out, lse = decode(**catalog.inputs("sparse_decode_fp8", {**params, "topk": 128}, 3))
    assert len(upstream.METADATA_CALLS) == 2 and out.shape == (2, 1, 8, 512) and lse.shape == (2, 8, 1)


def test_correct_attn_out_adapter_leaves_the_input_and_matches_the_stage():
    g = torch.Generator().manual_seed(new_seed())
    out_r = torch.randn(5, 4, 512, generator=g).to(torch.bfloat16)
    lses = torch.randn(3, 5, 4, generator=g) * 3
    kept = out_r.clone()
    partial, lse = upstream.lse_correct(out_r=out_r, lses=lses, rank=1)
    want_partial, want_lse = eager.dcp_lse_correct(kept, lses, 1)
    assert torch.equal(out_r, kept), "the adapter must hand upstream's in-place function a copy"
    assert torch.equal(partial, want_partial) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("padded", [False, True], ids=["heads_split", "heads_padded"])
def test_cp_lse_ag_out_rs_adapter_runs_the_ranks_as_a_group(ranks, padded):
    g = torch.Generator().manual_seed(new_seed())
    heads = 3 if padded else 2 * ranks  # 3: padded with empty heads to a multiple of the ranks
    outs = torch.randn(ranks, 4, heads, 512, generator=g).to(torch.bfloat16)
    lses = torch.randn(ranks, 4, heads, generator=g) * 3
    lses[0, 1] = -math.inf  # an empty shard
    out, lse = upstream.merge(outs=outs, lses=lses)
    want_out, want_lse = eager.dcp_merge(outs, lses)
    if not padded:  # the same per-rank terms, summed in the same order
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    else:  # logsumexp over another head count may vectorize differently: the last bits move
        torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out, want_out)


def test_cp_lse_ag_out_rs_is_undefined_for_one_rank_and_says_so():
    # Upstream returns the bare output for a world of one and its caller unpacks (out, lse) from it.
    outs, lses = torch.zeros(1, 4, 2, 512, dtype=torch.bfloat16), torch.zeros(1, 4, 2)
    with pytest.raises(ValueError, match="unpack"):
        upstream.merge(outs=outs, lses=lses)


def test_a_rank_that_raises_releases_the_others():
    def call(rank, group):
        if rank == 1:
            raise RuntimeError("rank 1 failed")
        return group.all_gather(torch.ones(1), dim=0)

    with pytest.raises(RuntimeError, match="rank 1 failed"):
        adapters.run_ranks(3, call)


def test_the_projects_flash_mla_implementation_calls_flash_mla_through_the_adapters(monkeypatch):
    """optimized/flashmla.py's launch path on CPU, with the stand-ins in place of the flash_mla module."""
    from mla_verify.optimized import flashmla

    calls = []

    def recorded(fn):
        def call(*args, **kwargs):
            calls.append((fn.__name__, kwargs.get("use_legacy")))
            return fn(*args, **kwargs)
        return call

    monkeypatch.setitem(sys.modules, "flash_mla", types.SimpleNamespace(
        flash_mla_sparse_fwd=recorded(upstream.flash_mla_sparse_fwd),
        flash_mla_with_kvcache=recorded(upstream.flash_mla_with_kvcache),
        get_mla_metadata=upstream.get_mla_metadata))
    seed = new_seed()
    kw = _prefill_kwargs(16, seed)
    out, lse, _ = flashmla.launch_sparse_prefill(**kw)
    want_out, want_lse, _ = eager.sparse_prefill(**kw)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, want_out, rtol=0, atol=2**-7 * want_out.abs().max().item())
    params = dict(batch=2, s_q=2, heads=8, topk=64, seq_lens=[40, 70], page_size=16, value_regime="normal",
                  scale_rule="pow2", sm_scale=0.1)
    decode_kw = catalog.inputs("sparse_decode_fp8", params, seed)
    out, lse = flashmla.launch_sparse_decode_fp8(**decode_kw)
    assert out.shape == (2, 2, 8, 512) and lse.shape == (2, 8, 2)
    torch.testing.assert_close(lse, eager.sparse_decode_fp8(**decode_kw)[1], rtol=1e-5, atol=1e-5)
    assert calls == [("flash_mla_sparse_fwd", True), ("flash_mla_with_kvcache", True)]


# ----------------------------------------------------------------------------- recognizing native signatures

NATIVE = [
    (upstream.flash_mla_sparse_fwd, "flash_mla_sparse_fwd"),
    (upstream.flash_mla_with_kvcache, "flash_mla_with_kvcache"),
    (upstream.triton_convert_req_index_to_global_index, "triton_convert_req_index_to_global_index"),
    (upstream.triton_filter_and_convert_dcp_index, "triton_filter_and_convert_dcp_index"),
    (upstream.correct_attn_out, "correct_attn_out"),
    (upstream.cp_lse_ag_out_rs, "cp_lse_ag_out_rs"),
]


@pytest.mark.parametrize("fn, adapter", NATIVE, ids=[a for _, a in NATIVE])
def test_a_native_signature_is_a_usage_error_naming_its_adapter(fn, adapter):
    # flash_mla_sparse_fwd accepts every keyword of the sparse_prefill contract: only its
    # signature tells it apart, before its (out, max_logits, lse) order fails as LSE errors.
    with pytest.raises(UsageError, match=rf"wrap it with mla_verify\.adapters\.{adapter}\(fn"):
        check_signature(fn, (), "--impl m:f")


@pytest.mark.parametrize("fn", [upstream.prefill, upstream.decode, upstream.convert_index, upstream.merge,
                                eager.sparse_prefill, eager.convert_index, eager.dcp_merge])
def test_contract_callables_and_adapted_ones_are_not_mistaken_for_native(fn):
    assert adapters.native_signature(fn) is None


def test_the_cli_names_the_adapter_for_flash_mlas_native_function(capsys):
    code, text = run(capsys, "fuzz", "--op", "sparse_prefill", "--impl", "tests.impls.upstream:flash_mla_sparse_fwd",
                     "--device", "cpu")
    assert code == 2 and "mla_verify.adapters.flash_mla_sparse_fwd" in text and len(text.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- declared deviations

DECODE = "tests.impls.bf16_dequant:sparse_decode_fp8"


def raw_scale_decode(regime: st.SearchStrategy[str]) -> st.SearchStrategy[Case]:
    return st.builds(lambda p, seed: Case("sparse_decode_fp8", p, seed),
                     decode_params(CI, scale_rule=st.just("raw"), value_regime=regime), seeds)


# Sized like a small production decode: at one head and 64 keys the bf16 rounding of the rows can
# stay inside the LSE bound by chance; here it sits 10-40x above it (seeds 0-4: 704-2630 units of 64).
SIZED_RAW_DECODE = dict(batch=2, heads=16, invalid=[], page_size=64, s_q=1, scale_rule="raw", seq_lens=[900, 1500],
                        sm_scale=0.1352, stride_pad=0, topk=512, value_regime="normal")


@settings(max_examples=3)
@given(case=st.builds(lambda seed: Case("sparse_decode_fp8", SIZED_RAW_DECODE, seed), seeds))
def test_bf16_dequant_fails_raw_scale_decode_cases_until_it_declares_the_deviation(case):
    undeclared = evaluate(case, resolve_subject("sparse_decode_fp8", [DECODE], "cpu"))
    lse = next(r for r in undeclared if r.tensor == "lse")
    assert not lse.passed and lse.value > lse.bound == 64, case.short()
    for subject in (resolve_subject("sparse_decode_fp8", [DECODE], "cpu", deviations=["bf16_dequant"]),
                    resolve_subject("sparse_decode_fp8", ["tests.impls.bf16_dequant:declared"], "cpu")):
        rows = evaluate(case, subject)
        assert subject.deviations == ("bf16_dequant",)
        assert all(r.passed for r in rows), [r.reason for r in rows if not r.passed]
        assert {r.deviation for r in rows} == {"bf16_dequant"}, "the rows name the deviation that set their bound"


@settings(max_examples=4)
@given(case=raw_scale_decode(st.sampled_from(REGIMES)))
def test_declared_bf16_dequant_passes_raw_scale_decode_cases_in_every_value_regime(case):
    # (Not every regime fails undeclared: saturated tiles dequantize to their bf16 amax exactly.)
    rows = evaluate(case, resolve_subject("sparse_decode_fp8", ["tests.impls.bf16_dequant:declared"], "cpu"))
    assert all(r.passed for r in rows), [r.reason for r in rows if not r.passed]


def test_declared_bf16_dequant_passes_a_peaked_row_its_rounded_logits_reweight():
    """One head, peaked values, raw scales: the bf16 keys' rounded logits reweight the row's softmax
    coherently, a mean relative error far over rounding noise from a correct kernel; the derived
    bound holds every element (why the deviation gates no abs_mean_err: equivalence/judge/policy.py)."""
    params = dict(batch=1, s_q=1, heads=1, topk=64, seq_lens=[100], page_size=16, stride_pad=0, value_regime="peaked",
                  scale_rule="raw", sm_scale=0.1352, invalid=[])
    rows = evaluate(Case("sparse_decode_fp8", params, 10),
                    resolve_subject("sparse_decode_fp8", ["tests.impls.bf16_dequant:declared"], "cpu"))
    out = next(r for r in rows if r.tensor == "out")
    assert abs(out.metrics.mean_err) > 0.03 and out.metrics.elem_bound_ratio <= 1
    assert all(r.passed for r in rows), [r.reason for r in rows if not r.passed]


def test_bf16_dequant_is_exact_with_power_of_two_scales():
    case = Case("sparse_decode_fp8", dict(batch=2, s_q=2, heads=8, topk=128, seq_lens=[90, 200], page_size=16,
                                          value_regime="normal", scale_rule="pow2", sm_scale=0.1352), new_seed())
    rows = evaluate(case, resolve_subject("sparse_decode_fp8", [DECODE], "cpu"))
    assert all(r.passed and r.deviation == "" for r in rows), case.short()


def test_the_cli_declares_deviations_and_the_case_file_keeps_them(capsys, tmp_path):
    common = ["--op", "sparse_decode_fp8", "--impl", DECODE, "--examples", "8", "--profile", "ci", "--seed", "1",
              "--device", "cpu"]
    code, text = run(capsys, "fuzz", *common, "--out", str(tmp_path / "plain"))
    assert code == 1 and "lse_fp32_units" in text and "scale_rule=raw" in text
    saved = max((tmp_path / "plain" / "failures").glob("*.json"), key=lambda f: f.stat().st_mtime)  # the minimized one
    assert run(capsys, "replay", str(saved), "--device", "cpu", "--impl", DECODE)[0] == 1
    assert run(capsys, "replay", str(saved), "--device", "cpu", "--impl", DECODE, "--deviation", "bf16_dequant")[0] == 0
    # A case file saved with a declaration replays with it.
    cf = casefile.load(saved)
    declared = casefile.save(tmp_path / "declared.json", casefile.CaseFile(cf.case, cf.impl, "cpu", cf.failure,
                                                                           deviations=("bf16_dequant",)))
    assert json.loads(declared.read_text())["deviations"] == ["bf16_dequant"]
    assert run(capsys, "replay", str(declared), "--device", "cpu", "--impl", DECODE)[0] == 0
    code, text = run(capsys, "fuzz", *common, "--deviation", "bf16_dequant", "--out", str(tmp_path / "declared"))
    cover = first_cases("sparse_decode_fp8", CI, None, None, (DECODE,), "cpu", 1)  # whole, the draws fill the rest
    assert code == 0 and f"PASS: {max(8, len(cover))} examples" in text


def test_a_declared_deviation_reaches_the_isolation_worker(capsys, tmp_path):
    code, text = run(capsys, "fuzz", "--op", "sparse_decode_fp8", "--impl", DECODE, "--deviation", "bf16_dequant",
                     "--examples", "3", "--profile", "ci", "--seed", "1", "--device", "cpu", "--isolate",
                     "--out", str(tmp_path))
    assert code == 0 and "isolated" in text


def test_a_whole_forward_mqa_carries_its_declared_deviation_into_the_rows():
    corpus = json.loads((Path(__file__).parents[1] / "fuzz" / "corpus" / "forward_mqa.json").read_text())
    raw = next(c for c in corpus if c["params"]["scale_rule"] == "raw" and c["params"]["dcp_size"] == 1)
    case = Case(raw["op"], raw["params"], raw["seed"])
    subject = resolve_subject("forward_mqa", ["tests.impls.bf16_dequant:whole_forward_mqa"], "cpu",
                              deviations=["bf16_dequant"])
    rows = evaluate(case, subject)
    assert subject.deviations == ("bf16_dequant",) and all(r.passed for r in rows)
    assert {r.deviation for r in rows} == {"bf16_dequant"}, case.short()


@pytest.mark.parametrize("argv, message", [
    (["fuzz", "--op", "sparse_decode_fp8", "--impl", DECODE, "--deviation", "bf16_dequantize"], "unknown deviation"),
    (["fuzz", "--op", "sparse_decode_fp8", "--impl", "tests.impls.bf16_dequant:misdeclared"], "unknown deviation"),
    (["fuzz", "--op", "sparse_decode_fp8", "--impl", "torch-fp32", "--deviation", "bf16_dequant"], "user's --impl"),
    (["fuzz", "--op", "sparse_decode_fp8", "--deviation", "bf16_dequant"], "user's --impl"),
])
def test_deviation_usage_errors_exit_2(capsys, tmp_path, argv, message):
    code, text = run(capsys, *argv, "--device", "cpu", "--out", str(tmp_path))
    assert code == 2 and message in text and len(text.strip().splitlines()) == 1


def test_replay_refuses_an_unknown_deviation(capsys, tmp_path):
    saved = casefile.save(tmp_path / "c.json", casefile.CaseFile(
        Case("quantize_fp8_ds_mla", {"n": 4, "value_regime": "normal", "scale_rule": "pow2"}, 1),
        ("mla_verify.reference:quantize_fp8_ds_mla",)))
    code, text = run(capsys, "replay", str(saved), "--device", "cpu", "--impl", "mla_verify.reference:quantize_fp8_ds_mla",
                     "--deviation", "nope")
    assert code == 2 and "unknown deviation 'nope'" in text


def test_list_deviations_shows_meaning_and_bounds(capsys):
    from mla_verify.equivalence.judge.policy import DEVIATIONS

    code, text = run(capsys, "list", "--device", "cpu", "--deviations")
    section = text[text.index("deviations (declare"):]
    assert code == 0 and all(f"\n  {name}\n" in section for name in DEVIATIONS)
    assert "lse_fp32_units <= 6.557e+04" in section and "applies to:" in section
    assert max(map(len, section.splitlines())) <= 100


# ----------------------------------------------------------------------------- the real flash_mla (H200)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["sparse_prefill", "sparse_decode_fp8"])
def test_real_flash_mla_through_the_adapters_passes_the_oracle(op):
    seed, result = campaign(op, f"tests.impls.native_flashmla:{op}", examples=10, device="cuda",
                            profile=get_profile("gpu"))
    assert result.failure is None, f"seed {seed}: {result.failure.case.short()}"
    assert result.examples == 10


@pytest.mark.gpu
def test_real_flash_mla_functions_unadapted_are_usage_errors():
    import flash_mla

    for fn, adapter in ((flash_mla.flash_mla_sparse_fwd, "flash_mla_sparse_fwd"),
                        (flash_mla.flash_mla_with_kvcache, "flash_mla_with_kvcache")):
        with pytest.raises(UsageError, match=rf"mla_verify\.adapters\.{adapter}\(fn"):
            check_signature(fn, (), "--impl flash_mla:" + adapter)


@pytest.mark.gpu
def test_the_adapter_passes_flash_mla_through_unchanged_at_its_own_head_counts():
    import flash_mla

    for heads in (64, 128):
        # No topk_length: lanes past a drawn length may name the NaN-poisoned unselected rows.
        kw = _prefill_kwargs(heads, new_seed(), topk_length="none", sink="none")
        kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        out, lse, max_logits = adapters.flash_mla_sparse_fwd(flash_mla.flash_mla_sparse_fwd, use_legacy=True)(**kw)
        raw_out, raw_max, raw_lse = flash_mla.flash_mla_sparse_fwd(
            kw["q"], kw["kv"].unsqueeze(1), kw["indices"].unsqueeze(1), kw["sm_scale"], use_legacy=True)
        assert not out.isnan().any()
        assert torch.equal(out, raw_out) and torch.equal(lse, raw_lse) and torch.equal(max_logits, raw_max)
