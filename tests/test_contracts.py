"""The contract is declared once (equivalence/contracts.py): every op spec takes its keywords from
its Protocol, every Protocol belongs to an op, and a user's callable is held to those keywords."""

import re

import pytest

from mla_verify.equivalence import catalog, contracts
from mla_verify.equivalence.errors import UsageError
from mla_verify.equivalence.subject import check_signature


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


def test_the_docs_contract_table_is_the_rendered_one():
    """docs/reference/contracts.md's table between the contracts markers is `contract_table()`'s output, exactly,
    and docs/v4.md's is `contract_table(V4_OPS)`'s."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "scripts"))
    try:
        import contract_table
    finally:
        sys.path.pop(0)
    for page, table in ((contract_table.PAGE, contracts.contract_table()),
                        (contract_table.V4_PAGE, contracts.contract_table(contracts.V4_OPS))):
        assert contract_table.region(page.read_text()) == table, (
            f"{page.name}'s contract table drifted from equivalence/contracts.py: run {contract_table.COMMAND}")


def test_the_table_has_a_row_per_contract_showing_each_keyword_in_order_with_its_shape():
    table = contracts.contract_table()
    assert [row.split(" | ")[0].strip("| `") for row in table.splitlines()[2:]] == list(contracts.CONTRACTS)
    for op in contracts.CONTRACTS:
        pairs = zip(contracts.arguments(op), contracts.declared(op), strict=True)
        assert all(re.match(rf"{name}\b", text) for name, text in pairs), op
    assert "`q[T,H,576] bf16, kv[N,576] bf16, indices[T,K] int32, sm_scale: float," in table
    assert "`(out[T,H,512] bf16, lse[T,H] f32[, max_logits[T,H] f32])`" in table
