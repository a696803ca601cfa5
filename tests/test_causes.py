"""Findings by cause (mla_verify.reports.causes, issue 50 item 2): one bug found ten ways reads as one
group, put down to the kernel the rows name; what no kernel is known for groups apart. The run of a
truncating bf16 epilogue that reads as one group is in test_corpus.py (it keeps findings there too)."""

from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.judge.rows import Row
from mla_verify.reports.causes import JOINED, by_cause, lines, table
from mla_verify.reports.store import rows_frame
from mla_verify.runs.outcome import CheckResult, Failure

K = "mine:prefill"   # the buggy sparse_prefill
B = "mine:convert"   # a second buggy kernel, of convert_index
FP32 = "torch-fp32"
PLAIN = (("concat_mla_q", FP32), ("convert_index", FP32), ("sparse_prefill", K))


def row(finding: str, op: str, impl: str, stages=(), path: str | None = None, differing: str = "",
        passed: bool = False, tensor: str = "out") -> Row:
    return Row("run", f"case-{finding}", op, path or op, tensor, impl, tuple(stages), "cpu", 1, "fuzz",
               gate_metric="abs_mean_err", value=2e-3, bound=1e-3, passed=passed, finding=finding,
               differing_stage=differing)


def test_one_kernel_found_by_its_op_pipelines_and_properties_is_one_group():
    rows = [
        row("op.json", "sparse_prefill", K),                                   # the op: its own kernel
        row("op.json", "sparse_prefill", K, passed=True, tensor="lse"),        # a passing row names it too
        row("bf16.json", "forward_mqa", "pipeline[sparse_prefill=mine:prefill]", PLAIN, "bf16",
            differing="sparse_prefill"),                                       # traced: its first differing stage
        row("hisparse.json", "forward_mqa", "pipeline[sparse_prefill=mine:prefill]", PLAIN, "bf16_hisparse"),
        row("split.json", "property", f"sparse_prefill={K}", (("sparse_prefill", K),), "split_invariance"),
        row("dep.json", "property", f"sparse_prefill={K}",
            (("dequantize_fp8_ds_mla", FP32), ("sparse_decode_fp8", FP32), ("sparse_prefill", K)),
            "decode_equals_prefill"),
        row("", "sparse_prefill", K),                                          # a failing case, no finding: evidence
    ]
    group, = by_cause(rows)
    assert str(group.cause) == f"stage sparse_prefill ({K})"
    assert [f.name for f in group.findings] == ["op.json", "bf16.json", "hisparse.json", "split.json", "dep.json"]
    # an untraced pipeline and a property of two kernels join the one failing kernel their case ran, and say so
    assert [f.joined for f in group.findings] == [False, False, True, False, True]
    text = lines([group])
    assert text[0] == f"  stage sparse_prefill ({K}): 5 findings, first sparse_prefill: out abs_mean_err = 0.002 > 0.001"
    assert text[1:] == [f"    {f.name} ({f.where()}: out abs_mean_err = 0.002 > 0.001{f'; {JOINED}' * f.joined})"
                        for f in group.findings]
    assert list(table([group])["case file"]) == [f.name for f in group.findings]


def test_what_no_kernel_is_known_for_groups_apart():
    two = (("convert_index", B), ("sparse_prefill", K))
    rows = [
        row("k.json", "sparse_prefill", K),
        row("b.json", "convert_index", B), row("b2.json", "convert_index", B, tensor="valid_counts"),
        # both failing kernels ran: which one broke it is not known
        row("both.json", "forward_mqa", "pipeline[both]", two, "fp8_mixed"),
        row("prop.json", "property", "both", two, "padding_and_order"),
        # every stage matched on its own inputs: the pipeline's composition, not a kernel
        row("glue.json", "forward_mqa", "pipeline[both]", two, "bf16", differing="forward_mqa"),
        # a pipeline whose stages ran no kernel that failed otherwise
        row("alone.json", "forward_mqa", "pipeline", (("convert_index", FP32),), "fp8_separate"),
    ]
    groups = {str(g.cause): [f.name for f in g.findings] for g in by_cause(rows)}
    assert groups == {f"stage convert_index ({B})": ["b.json", "b2.json"], f"stage sparse_prefill ({K})": ["k.json"],
                      "forward_mqa fp8_mixed (pipeline[both])": ["both.json"],
                      "property padding_and_order (both)": ["prop.json"],
                      "forward_mqa bf16 (pipeline[both])": ["glue.json"],
                      "forward_mqa fp8_separate (pipeline)": ["alone.json"]}
    assert list(groups)[0] == f"stage convert_index ({B})"  # the largest group first
    assert by_cause([row("x.json", "sparse_prefill", K, passed=True)]) == []


def test_a_fuzz_run_of_several_findings_ends_with_them_by_cause():
    """A kept case that still fails and the campaign's own (or --parallel parts' findings) of one
    kernel: the discrepancies, then one group, where a finding alone says nothing more."""
    rows = [row("kept.json", "sparse_prefill", K), row("own.json", "sparse_prefill", K)]
    failures = [Failure.of(Case("sparse_prefill", {}, n), [r], None, "mla-verify replay ...")
                for n, r in enumerate(rows)]
    report = CheckResult("sparse_prefill", K, False, rows_frame(rows), 1, 2, None, failures).report()
    assert report.endswith(f"FAIL: 2 findings, by cause:\n  stage sparse_prefill ({K}): 2 findings, first sparse_prefill: "
                           "out abs_mean_err = 0.002 > 0.001\n    kept.json (sparse_prefill: out abs_mean_err = 0.002 > "
                           "0.001)\n    own.json (sparse_prefill: out abs_mean_err = 0.002 > 0.001)")
    alone = CheckResult("sparse_prefill", K, False, rows_frame(rows[:1]), 1, 1, None, failures[:1]).report()
    assert "by cause" not in alone
