"""A replaced stage is exercised or there is no verdict (exit 4, NO VERDICT); the CI log of a
pipeline failure names the first stage that differs; each stage's metadata invariants are checked
after every call, reported with the stage's name (issue 47)."""

import pytest
import torch

from mla_verify import reference
from mla_verify.cli import main
from mla_verify.equivalence.catalog import get_spec
from mla_verify.equivalence.sandbox.invariants import broken
from mla_verify.fuzz.campaign import drawn_paths
from mla_verify.runs.selection import impl_units

STALE = "index_group=tests.zoo.hisparse:followers_read_stale_buffer"


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_campaign_replacing_a_stage_draws_the_paths_that_call_it():
    forward = get_spec("forward_mqa")
    assert forward.paths_calling(["index_group"]) == ("bf16_hisparse", "fp8_separate_hisparse")
    assert drawn_paths("forward_mqa", None, (STALE,)) == ("bf16_hisparse", "fp8_separate_hisparse")
    assert drawn_paths("forward_mqa", None, ("convert_index=torch-fp32",)) == (None,)  # the unrestricted draw calls it
    assert drawn_paths("forward_mqa", "bf16", (STALE,)) == ("bf16",)                    # a --path is kept
    assert forward.paths_calling(["reshape_query_for_spec_decode"]) == ("fp8_separate", "fp8_separate_hisparse")


def test_gate_impl_brings_every_path_that_calls_a_replaced_stage():
    by_op = {u.op: u for u in impl_units(["reshape_query_for_spec_decode=torch"], "cpu")}
    assert by_op["forward_mqa"].paths == ("fp8_separate", "fp8_separate_hisparse")
    assert by_op["reshape_query_for_spec_decode"].specs == ("torch",)
    assert impl_units(["index_group=torch-fp32"], "cpu")[0].paths == ("bf16_hisparse", "fp8_separate_hisparse")


def test_a_replaced_stage_never_called_is_no_verdict(capsys, tmp_path):
    code, text = run_cli(capsys, "fuzz", "--op", "forward_mqa", "--path", "bf16", "--impl", STALE, "--profile", "ci",
                         "--examples", "1", "--seed", "1", "--device", "cpu", "--no-isolate", "--out", str(tmp_path / "r"))
    assert code == 4, text
    assert ("NO VERDICT: index_group never called by these" in text
            and "forward_mqa's paths that call it: bf16_hisparse, fp8_separate_hisparse" in text)
    assert "PASS" not in text


def test_the_stage_it_replaces_drawn_a_hisparse_stage_is_caught_without_a_path(capsys, tmp_path):
    code, text = run_cli(capsys, "fuzz", "--op", "forward_mqa", "--impl", STALE, "--profile", "ci", "--seed", "2",
                         "--device", "cpu", "--no-isolate", "--no-shrink", "--out", str(tmp_path / "r"))
    assert code == 1 and "DISCREPANCY in forward_mqa" in text and "NO VERDICT" not in text


def test_the_ci_log_of_a_pipeline_failure_names_the_first_stage_that_differs(capsys, tmp_path):
    """Isolated, not shrunk (a ci campaign's failure is a covering case): the first re-run is
    traced in the worker and the printed finding names the stage."""
    code, text = run_cli(capsys, "fuzz", "--op", "forward_mqa", "--path", "fp8_separate", "--impl",
                         "convert_index=tests.zoo.indices:prefill_base_added_twice", "--profile", "ci", "--seed", "1",
                         "--device", "cpu", "--isolate", "--no-shrink", "--examples", "1",
                         "--out", str(tmp_path / "r"))
    assert code == 1 and "case (as found, not minimized)" in text
    assert "stage convert_index is the first whose output differs from the reference's on the same inputs" in text


def _converted(**kw):
    base = dict(req_id=torch.tensor([0, 0, 1], dtype=torch.int32), block_table=torch.tensor([[3, 1], [2, 0]], dtype=torch.int32),
                topk_indices=torch.tensor([[0, 5, -1, 40], [-7, 2, 3, 17], [1, -1, 30, 4]], dtype=torch.int32),
                block_size=16)
    return {**base, **kw}


@pytest.mark.parametrize("counts", [False, True])
def test_the_references_converter_keeps_the_invariants(counts):
    kw = _converted(return_valid_counts=counts)
    assert broken("convert_index", kw, reference.convert_index(**kw)) is None


def test_an_invalid_entry_other_than_minus_one_breaks_the_converters_invariant():
    kw = _converted()
    out = reference.convert_index(**kw)
    why = broken("convert_index", kw, torch.where(out < 0, -2, out))
    assert why.startswith("metadata invariant: entry [0, 2] is -2: an invalid entry is exactly -1")


def test_a_valid_count_off_by_one_and_a_row_not_compacted_break_it():
    kw = _converted(return_valid_counts=True)
    rows, counts = reference.convert_index(**kw)
    assert "valid count 3 for 2 valid entries" in broken("convert_index", kw, (rows, counts + 1))
    assert "are not its first" in broken("convert_index", kw, (rows.flip(1), counts))


def test_chunks_that_skip_a_request_or_overflow_the_workspace_break_the_splits_invariant():
    kw = {"seq_lens": [2, 3, 4, 2], "workspace_size": 5}
    assert broken("split_prefill_chunks", kw, reference.split_prefill_chunks(**kw)) is None
    assert "do not cover requests 0-3" in broken("split_prefill_chunks", kw, [(0, 2), (3, 4)])
    assert "past the workspace's 5" in broken("split_prefill_chunks", kw, [(0, 3), (3, 4)])


def test_the_pipeline_reports_a_broken_invariant_with_the_stages_name(capsys, tmp_path):
    """The BF16 path's prefill kernel skips -2 as it skips -1: only the converter's invariant shows it."""
    code, text = run_cli(capsys, "fuzz", "--op", "forward_mqa", "--path", "bf16", "--impl",
                         "convert_index=tests.zoo.indices:invalid_entries_not_minus_one", "--profile", "ci",
                         "--seed", "3", "--examples", "1", "--device", "cpu", "--no-isolate", "--no-shrink",
                         "--out", str(tmp_path / "r"))
    assert code == 1 and "stage convert_index (tests.zoo.indices:invalid_entries_not_minus_one): metadata invariant" in text
