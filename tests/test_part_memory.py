"""A judge that runs out of device memory (issue 48: four parts of `--parallel 4` on an H100, each held
to 9.9 GiB, died of it with exit 3 for the whole run): its block waits and runs again, then one case
at a time; a case that still does not fit is a `not_judged` row of the part's log, counted, never
failed and never silent, and the run goes on. The implementation's own failures are untouched. On
CPU the reference is made to raise torch's OutOfMemoryError, as the judge's side meets it on a GPU."""

import pytest
import torch

import mla_verify
from mla_verify import reference
from mla_verify.cli import main
from mla_verify.equivalence.judge.rows import FailureKind, RowContext
from mla_verify.runs import driver


def _failing_reference(monkeypatch, times: int | None):
    """The decode reference raising OutOfMemoryError its first `times` calls (None: always)."""
    real, calls = reference.sparse_decode_fp8, []

    def oom(*args, **kwargs):
        calls.append(True)
        if times is None or len(calls) <= times:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (9.90 GiB allowed)")
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "sparse_decode_fp8", oom)
    monkeypatch.setattr(driver, "OOM_WAITS", (0.0, 0.0))
    return calls


@pytest.mark.parametrize("isolate", [False, True])
def test_a_judge_out_of_memory_once_waits_and_judges_the_block(monkeypatch, isolate):
    calls = _failing_reference(monkeypatch, 1)
    result = mla_verify.check("sparse_decode_fp8", "torch-fp32", examples=3, seed=3, profile="ci", device="cpu",
                              isolate=isolate)
    assert result.passed and len(calls) > 1
    assert (result.rows.gate_metric != FailureKind.NOT_JUDGED).all() and "not judged" not in result.report()


def test_a_case_that_never_fits_is_a_counted_row_not_a_harness_error(monkeypatch, capsys, tmp_path):
    _failing_reference(monkeypatch, None)
    result = mla_verify.check("sparse_decode_fp8", "torch-fp32", examples=3, seed=3, profile="ci", device="cpu",
                              isolate=False)
    rows = result.rows
    assert result.passed and len(rows) and (rows.gate_metric == FailureKind.NOT_JUDGED).all()
    assert rows.reason.str.contains("ran out of device memory").all()
    assert f"{rows.case_id.nunique()} cases not judged, the judge ran out of device memory" in result.report()
    code = main(["gate", "--op", "sparse_decode_fp8", "--impl", "sparse_decode_fp8=torch-fp32", "--examples", "2",
                "--device", "cpu", "--no-isolate", "--out", str(tmp_path / "gate")])
    assert code == 0 and "cases not judged, the judge ran out of device memory" in capsys.readouterr().out


def test_a_block_retried_after_running_out_tells_the_campaign_of_each_call_once(monkeypatch):
    """The retry of a block whose judge ran out of memory after two of its calls (the H100's
    `--parallel 4`): the campaign hears of each case's call once (a second telling ended the run
    with `IndexError: pop from empty list`), and every case is judged."""
    from mla_verify.equivalence import catalog
    from mla_verify.equivalence.cases.profiles import get_profile
    from mla_verify.fuzz.campaign import Campaign, fuzz
    from mla_verify.runs.units import Unit

    monkeypatch.setattr(driver, "OOM_WAITS", (0.0, 0.0))
    subject = catalog.resolve_subject("sparse_decode_fp8", ["torch-fp32"], "cpu")
    blocks = []

    def judge(cases, source, on_call):
        blocks.append(len(cases))
        if len(blocks) == 1:
            on_call(), on_call()
            raise torch.OutOfMemoryError("CUDA out of memory (9.90 GiB allowed)")
        return catalog.evaluate_block(cases, subject, "cpu", source=source, on_call=on_call)

    unit = Unit("sparse_decode_fp8", "torch-fp32", ("torch-fp32",))
    result = fuzz(Campaign("sparse_decode_fp8", get_profile("ci"), 6, 1, block=3, shrink=False),
                  driver._within_memory(judge, RowContext("run", label=unit.label)))
    assert result.stopped is None and result.examples == 6 and blocks[:2] == [3, 3]
    assert result.rows and all(r.passed and r.gate_metric != FailureKind.NOT_JUDGED for r in result.rows)
