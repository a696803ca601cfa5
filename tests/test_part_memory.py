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
from mla_verify.runs import judges


def _failing_reference(monkeypatch, times: int | None, op: str = "sparse_decode_fp8"):
    """`op`'s reference (the decode's by default) raising OutOfMemoryError its first `times` calls
    (None: always)."""
    real, calls = getattr(reference, op), []

    def oom(*args, **kwargs):
        calls.append(True)
        if times is None or len(calls) <= times:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (9.90 GiB allowed)")
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, op, oom)
    monkeypatch.setattr(judges, "OOM_WAITS", (0.0, 0.0))
    return calls


@pytest.mark.parametrize("isolate", [False, True])
def test_a_judge_out_of_memory_once_waits_and_judges_the_block(monkeypatch, isolate):
    calls = _failing_reference(monkeypatch, 1)
    result = mla_verify.check("sparse_decode_fp8", "torch-fp32", examples=3, seed=3, profile="ci", device="cpu",
                              isolate=isolate)
    assert result.passed and len(calls) > 1
    assert (result.rows.gate_metric != FailureKind.NOT_JUDGED).all() and "not judged" not in result.report()


def test_a_case_that_never_fits_is_a_counted_row_not_a_harness_error(monkeypatch, capsys, tmp_path):
    """Never failed, never exit 3; a run whose every case went unjudged is NO VERDICT (exit 4), no pass."""
    _failing_reference(monkeypatch, None)
    _failing_reference(monkeypatch, None, "concat_mla_q")
    # three drawn cases; the gate below runs concat_mla_q's covering set, every case unjudged (the
    # decode's holds production sizes: 31 cases, half a minute on CPU for the same exit)
    result = mla_verify.check("sparse_decode_fp8", "torch-fp32", examples=3, seed=3, profile="ci", device="cpu",
                              isolate=False, covering=False)
    rows = result.rows
    assert not result.failures and len(rows) and (rows.gate_metric == FailureKind.NOT_JUDGED).all()
    assert not result.passed and result.exit_code == 4 and "nothing was judged" in result.no_verdict
    assert rows.reason.str.contains("ran out of device memory").all()
    assert f"{rows.case_id.nunique()} cases not judged, the judge ran out of device memory" in result.report()
    code = main(["gate", "--op", "concat_mla_q", "--impl", "concat_mla_q=torch-fp32", "--examples", "2",
                "--device", "cpu", "--no-isolate", "--out", str(tmp_path / "gate")])
    out = capsys.readouterr().out
    assert code == 4 and "cases not judged, the judge ran out of device memory" in out and "NO VERDICT" in out


def test_a_block_retried_after_running_out_tells_the_campaign_of_each_call_once(monkeypatch):
    """The retry of a block whose judge ran out of memory after two of its calls (the H100's
    `--parallel 4`): the campaign hears of each case's call once (a second telling ended the run
    with `IndexError: pop from empty list`), and every case is judged."""
    from mla_verify.equivalence import catalog
    from mla_verify.equivalence.cases.profiles import get_profile
    from mla_verify.fuzz.campaign import Campaign, fuzz
    from mla_verify.runs.units import Unit

    monkeypatch.setattr(judges, "OOM_WAITS", (0.0, 0.0))
    subject = catalog.resolve_subject("sparse_decode_fp8", ["torch-fp32"], "cpu")
    blocks = []

    def judge(cases, source, on_call):
        blocks.append(len(cases))
        if len(cases) == 3 and blocks.count(3) == 1:  # the first drawn block (the covering cases come one by one)
            on_call(), on_call()
            raise torch.OutOfMemoryError("CUDA out of memory (9.90 GiB allowed)")
        return catalog.evaluate_block(cases, subject, "cpu", source=source, on_call=on_call)

    unit = Unit("sparse_decode_fp8", "torch-fp32", ("torch-fp32",))
    result = fuzz(Campaign("sparse_decode_fp8", get_profile("ci"), 40, 1, block=3, shrink=False),
                  judges._within_memory(judge, RowContext("run", label=unit.label)))
    # the whole covering set runs past --examples (issue 47), then the drawn block, retried whole
    first = blocks.index(3)
    assert result.stopped is None and result.examples >= 40 and blocks[first:first + 2] == [3, 3]
    assert result.rows and all(r.passed and r.gate_metric != FailureKind.NOT_JUDGED for r in result.rows)


def test_the_input_pools_keep_within_their_bytes_and_give_the_same_rows_again(monkeypatch):
    """On the H100 (`fuzz --parallel 4`, 5 GiB a worker) the pools of every regime and format kept
    whole filled a worker building decode inputs: they are kept up to POOL_BYTES, the least recently
    used evicted and packed again from their seed, the same bytes."""
    from mla_verify.equivalence.cases import values

    values.release_pools()
    gen = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    first = {r: values.pooled_rows(gen(), 300, r, "fp8_ds_mla") for r in ("normal", "outliers", "peaked")}
    monkeypatch.setattr(values, "POOL_BYTES", {**values.POOL_BYTES, "cpu": 3 * values.POOL_ROWS["cpu"] * 576 * 2})
    monkeypatch.setattr(values, "ON_THE_SPOT_ROWS", {**values.ON_THE_SPOT_ROWS, "cpu": 0})
    values.release_pools()
    for regime in ("normal", "outliers", "peaked", "normal"):
        again = values.pooled_rows(gen(), 300, regime, "fp8_ds_mla")
        assert all(torch.equal(a, b) for a, b in zip(again, first[regime]))
        assert sum(p.nbytes for p in values._POOLS.values()) <= values.POOL_BYTES["cpu"]
    assert ("packed", "peaked", "fp8_ds_mla", "pow2", "cpu") in values._POOLS  # the most recent kept
    values.release_pools()


def test_a_worker_short_of_memory_before_the_call_gives_its_pools_back_and_builds_again(monkeypatch):
    """The worker's own side (building a case's inputs) out of device memory: the pools and the
    allocator's cache given back, built once more; after the implementation was called, the error
    is the call's (the caller's crash rules), never retried."""
    from mla_verify.equivalence import serve

    released, tries = [], []
    monkeypatch.setattr(serve, "release_pools", lambda: released.append(True))

    def attempt():
        tries.append(True)
        if len(tries) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB (4.95 GiB allowed)")
        return "produced"

    assert serve._with_room(attempt, called=[]) == "produced" and released == [True] and len(tries) == 2
    tries.clear()
    with pytest.raises(torch.OutOfMemoryError):
        serve._with_room(attempt, called=[True])
    assert len(tries) == 1 and released == [True]
