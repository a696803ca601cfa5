"""The bench's own instruments on CPU (its numbers are measured on the GPU, never asserted here):
the stage breakdown it prints for the harness case, and what that breakdown proves by design:
a case's inputs are drawn without reading anything back from the device."""

import pytest

from mla_verify.bench.bench import OpCounter, stage_profile, table
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.catalog import get_spec, resolve_subject

DECODE = Case("sparse_decode_fp8", {"batch": 3, "s_q": 2, "heads": 16, "topk": 128, "seq_lens": [300, 1, 70], "page_size": 16,
                                    "stride_pad": 1, "value_regime": "normal", "scale_rule": "raw", "sm_scale": 0.1,
                                    "invalid": ["scattered", "whole_row", "duplicates"]}, 5)
PREFILL = Case("sparse_prefill", {"tokens": 5, "heads": 16, "kv_rows": 300, "topk": 128, "value_regime": "outliers",
                                  "sm_scale": 0.1, "invalid": ["negatives", "out_of_range", "whole_row"],
                                  "topk_length": "random", "sink": "inf"}, 6)


@pytest.mark.parametrize("case", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_inputs_read_nothing_back_from_the_device(case):
    counter = OpCounter()
    with counter:
        get_spec(case.op).inputs(get_spec(case.op).params_of(case.params), case.seed, "cpu")
    assert counter.ops > 10 and counter.reads_back == 0


def test_stage_profile_covers_every_stage_of_a_case():
    stages = stage_profile(DECODE, resolve_subject(DECODE.op, ["torch-fp32"], "cpu"), "cpu")
    assert list(stages) == ["inputs", "snapshot", "kernel", "reference", "judge"]
    for name, stage in stages.items():
        assert stage["ms"] > 0 and stage["ops"] > 0 and stage["launches"] is None, name
    assert stages["reference"]["reads_back"] == 1  # the decode index check, before any gather
    rows = [{"kind": "stage", "shape": "decode", "impl": name, "ms": s["ms"], "ops_note": f"{s['ops']} ops"}
            for name, s in stages.items()]
    assert "judge" in table(rows) and f"{stages['judge']['ops']} ops" in table(rows)


def test_the_guards_section_times_every_guard_and_isolation():
    from mla_verify.bench.guard_bench import bench_guards

    rows = bench_guards("cpu", DECODE, quick=True)
    guards = [r["impl"] for r in rows]
    sweep = [f"message{size}{how}" for size in ("", " 1 MiB", " 4 MiB", " 16 MiB", " 64 MiB") for how in ("", ", segment")]
    assert guards == ["process_state", "judge_functions", "judge_functions, block", "sigint_watch", "inputs",
                      "owned_outputs", "after_return", *sweep, "inputs built", "inputs handed over", "journal",
                      "isolation", "isolation", "sandbox off", "sandbox auto", "sandbox cost", "sandbox set-up"]
    assert all(r["ms"] > 0 for r in rows if r["impl"] not in ("isolation", "sandbox cost"))
    off, auto = rows[-4:-2]
    assert off["ops_note"].startswith("sandbox off;") and auto["ops_note"].startswith("sandbox auto")
    assert all(r["first_case_ms"] > 0 and r["after_crash_ms"] > 0 for r in (off, auto))
    small, decode = rows[-6:-4]
    assert small["after_crash_ms"] > 0 and decode["after_crash_ms"] is None
    assert all(r["in_process_ms"] > 0 and r["isolated_ms"] > 0 and r["first_case_ms"] > 0 for r in (small, decode))


def test_parallel_throughput_runs_its_parts_together():
    """The harness section's last rows: campaigns at once, each warmed up off the clock (on CPU
    here; on the H200 they share the GPU)."""
    from mla_verify.bench.bench import parallel_throughput

    row = parallel_throughput("cpu", "ci", 4, 1, 2, isolated=False)
    assert row["cases"] == 4 and row["cases_per_s"] > 0 and "2 parts in-process" in row["impl"]
