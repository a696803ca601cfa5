"""The contract is declared once (equivalence/contracts.py): every op spec takes its keywords from
its Protocol, every Protocol belongs to an op, and a user's callable is held to those keywords."""

import pytest

from mla_verify.equivalence import catalog, contracts
from mla_verify.equivalence.subject import UsageError, check_signature


def test_every_op_has_one_contract_and_takes_its_keywords_from_it():
    ops = {spec.name for spec in catalog.specs("op")}
    assert ops == set(contracts.CONTRACTS)
    for spec in catalog.specs("op"):
        assert spec.arguments == contracts.arguments(spec.name) and spec.arguments, spec.name
        assert contracts.formula(spec.name), f"{spec.name}: a contract without its formula"


def test_a_callable_missing_a_contract_keyword_is_refused():
    def prefill(q, kv, indices, sm_scale, topk_length):  # no attn_sink
        return q

    with pytest.raises(UsageError, match="attn_sink"):
        check_signature(prefill, contracts.arguments("sparse_prefill"), "--impl x:prefill")


def test_list_op_prints_the_formula(capsys):
    from mla_verify.cli import main

    assert main(["list", "--device", "cpu", "--op", "dcp_merge"]) == 0
    text = " ".join(capsys.readouterr().out.replace("|", " ").split())  # the formula is wrapped to the width
    assert "lse = ln sum_r e^(lse_r), out = sum_r bf16(e^(lse_r - lse) out_r)" in text
