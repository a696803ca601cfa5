"""Declared conventions (issue 25 item 3): a kernel whose LSE is base 2 and whose empty rows have
LSE -inf (tests/impls/conventions.py) passes only with its conventions declared, converted once at
its boundary (an op, a stage inside forward_mqa); undeclared, it fails with the convention named.
The declaration travels in the case file, so a replay converts the same way."""

import math

import pytest

from mla_verify import api
from mla_verify.cli import main
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.catalog import evaluate, resolve_subject
from mla_verify.equivalence.judge.conventions import Declared, parse
from mla_verify.equivalence.errors import UsageError
from mla_verify.fuzz import casefile

PREFILL = "tests.impls.conventions:prefill_base2"
ALL = ["lse_base=2", "empty_lse=-inf", "max_logits_base=2"]
# tokens of lengths 0, 1, K - 1 and K: token rows with no valid key among them (seed 2: lengths 0, K, 0, 1)
EDGES = Case("sparse_prefill", {"tokens": 4, "heads": 4, "kv_rows": 300, "topk": 128, "value_regime": "normal",
                                "sm_scale": 0.1, "invalid": ["scattered"], "topk_length": "edges", "sink": "none"}, 2)


def rows_of(case, impl, conventions=()):
    return {r.tensor: r for r in evaluate(case, resolve_subject(case.op, [impl], "cpu", conventions=conventions), "cpu")}


def test_conventions_parse_from_the_cli_and_from_python_alike():
    assert parse(ALL) == parse({"lse_base": 2, "empty_lse": -math.inf, "max_logits_base": 2.0}) \
        == Declared("2", "-inf", "2")
    assert Declared("2", "-inf", "2").declarations() == tuple(ALL) and parse(None) == Declared()
    for bad, says in [(["lse_base=10"], "one of e, 2"), (["base=2"], "unknown convention 'base'"),
                      (["lse_base"], "expected KEY=VALUE"), (["lse_base=2", "lse_base=e"], "declared twice")]:
        with pytest.raises(UsageError, match=says):
            resolve_subject("sparse_prefill", [PREFILL], "cpu", conventions=bad)
    with pytest.raises(UsageError, match="registered implementations follow the reference's"):
        resolve_subject("sparse_prefill", ["torch-fp32"], "cpu", conventions=["lse_base=2"])
    with pytest.raises(UsageError, match="kernels that return an LSE"):
        resolve_subject("quantize_fp8_ds_mla", ["tests.impls.misbehaving:segfaults"], "cpu",
                        conventions=["lse_base=2"])


def test_the_base_2_minus_inf_kernel_passes_only_with_its_conventions_declared():
    declared = rows_of(EDGES, PREFILL, ALL)
    assert all(r.passed for r in declared.values()), [(r.tensor, r.reason) for r in declared.values()]
    lse = rows_of(EDGES, PREFILL)["lse"]
    assert not lse.passed and lse.gate_metric == "inf_mismatch"
    assert "-inf where the reference is +inf" in lse.reason and "declare --convention empty_lse=-inf" in lse.reason
    half = rows_of(EDGES, PREFILL, ["empty_lse=-inf"])
    assert "LSE matches the reference in base 2: declare --convention lse_base=2 if that is your kernel's " \
           "convention" in half["lse"].reason
    assert "declare --convention max_logits_base=2" in half["max_logits"].reason
    nat = rows_of(EDGES, "tests.zoo.attention:ignores_sink", ["lse_base=2"])["lse"]  # a natural-log kernel
    assert "LSE matches the reference times ln 2" in nat.reason


def test_decode_and_a_stage_inside_forward_mqa_convert_at_their_boundary():
    decode = Case("sparse_decode_fp8", {"batch": 2, "s_q": 1, "heads": 8, "topk": 64, "seq_lens": [40, 7],
                                        "page_size": 16, "stride_pad": 0, "value_regime": "normal",
                                        "scale_rule": "pow2", "sm_scale": 0.1, "invalid": ["whole_row"]}, 4)
    decode_impl = "tests.impls.conventions:decode_base2"
    assert all(r.passed for r in rows_of(decode, decode_impl, ALL[:2]).values())
    assert not rows_of(decode, decode_impl)["lse"].passed
    result = api.check("forward_mqa", {"sparse_prefill": PREFILL}, path="bf16", examples=2, seed=3, profile="ci",
                       device="cpu", conventions=dict(lse_base=2, empty_lse="-inf", max_logits_base=2))
    assert result.passed, result.report()
    assert not api.check("forward_mqa", {"sparse_prefill": PREFILL}, path="bf16", examples=2, seed=3, profile="ci",
                         device="cpu").passed


def test_the_case_file_records_the_conventions_and_replay_converts_the_same_way(tmp_path, capsys):
    code = main([str(a) for a in ["fuzz", "--op", "sparse_prefill", "--impl", "tests.impls.conventions:prefill_base2_ignores_topk_length",
                 "--profile", "ci", "--seed", "1", "--out", tmp_path / "run", *[a for c in ALL for a in ("--convention", c)]]])
    text = capsys.readouterr().out
    assert code == 1
    replay = next(line.split("replay: ")[1] for line in text.splitlines() if "replay: " in line)
    assert all(f"--convention {c}" in replay for c in ALL)
    saved = next((tmp_path / "run" / "failures").glob("*.json"))
    assert casefile.load(saved).conventions == tuple(ALL)
    again = api.replay(saved, "tests.impls.conventions:prefill_base2_ignores_topk_length", device="cpu")
    assert again.reproduced, again.notes
    # the same case through the fixed kernel: passes with the recorded conventions, fails without them
    assert api.replay(saved, PREFILL, device="cpu").passed
    assert not api.replay(saved, PREFILL, device="cpu", conventions=[]).passed
