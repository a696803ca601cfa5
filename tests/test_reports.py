"""reports/: run storage round trip, drift verdicts (planted drift flagged, reruns and noise-floor
doublings not), exit codes, and the rendered reports (self-contained HTML, markdown, terminal).

Synthetic runs are Rows with realistic metric magnitudes drawn from a seeded generator: out
rel_l2 ~2e-3 (1.2 bf16 units, worst element 1.5 steps), lse/max_logits max_abs ~1e-6 (0.4 fp32
units of the logit scale), exact tensors mismatch 0, each with
a 15% case-to-case spread (an rms or a max over thousands of elements concentrates), over the
forward_mqa paths and single ops, several impls, topk, heads, value regimes, and one group held to
a documented deviation (raw fp8 scales rounded to bf16 in the decode kernel).
"""

from __future__ import annotations

import base64
import json
import math
import re
from dataclasses import fields, replace

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_verify.equivalence.judge.metrics import Metrics
from mla_verify.equivalence.judge.rows import COLUMNS, KINDS, Row
from mla_verify.reports import (build_report, collect_meta, finish_meta, load_run, render_html,
                     render_markdown, rows_frame, run_report, terminal_summary, write_run)
from mla_verify.reports.kinds import annotate
from mla_verify.reports.plots import error_by_path, figures
from mla_verify.reports.store import JOURNAL, ROWS_PARQUET, SCHEMA

BF16_ROUNDING_REL_L2 = 1.66e-3   # rel_l2 of one bf16 rounding of Gaussian data
OUT_BOUND, STAT_BOUND = 2 / 128, 1.0e-5    # upstream FlashMLA's out rel and lse abs tolerances
DEVIATION = "bf16_scale_rounding"

# (op, path, impl, tensors); exact tensors are the contracts compared bit for bit
LAYOUT = (
    ("forward_mqa", "bf16", "pipeline", ("out", "lse")),
    ("forward_mqa", "fp8_mixed", "pipeline", ("out", "lse")),
    ("forward_mqa", "fp8_separate", "pipeline", ("out", "lse")),
    ("forward_mqa", "fp8_mixed_dcp", "pipeline", ("out", "lse")),
    ("sparse_prefill", "sparse_prefill", "flash_mla", ("out", "lse", "max_logits")),
    ("sparse_prefill", "sparse_prefill", "triton", ("out", "lse", "max_logits")),
    ("sparse_decode_fp8", "sparse_decode_fp8", "flash_mla", ("out", "lse")),
    ("sparse_decode_fp8", "sparse_decode_fp8", "triton", ("out", "lse")),
    ("convert_index", "convert_index", "triton", ("indices", "valid_counts")),
    ("concat_and_cache_ds_mla", "concat_and_cache_ds_mla", "triton", ("cache_bytes",)),
)
PATHS = sorted({path for _, path, _, _ in LAYOUT})
REGIMES = ("normal", "outliers", "tiny", "peaked")
REGIME_RMS = {"normal": 0.05, "outliers": 0.4, "tiny": 3e-4, "peaked": 0.08}


_METRICS = {f.name for f in fields(Metrics)}


def changed(row: Row, **changes) -> Row:
    """`row` with `changes`, each to its own field or to its metrics' (dataclasses.replace)."""
    metrics = {k: v for k, v in changes.items() if k in _METRICS}
    own = {k: v for k, v in changes.items() if k not in _METRICS}
    return replace(row, **own, metrics=replace(row.metrics, **metrics))


def _gated(row: Row, metric: str, bound: float) -> Row:
    value = getattr(row.metrics, metric)
    headroom = math.inf if value == 0 else bound / value
    return replace(row, gate_metric=metric, value=value, bound=bound, headroom=headroom,
                   passed=value <= bound,
                   reason="" if value <= bound else f"{metric} {value:.3g} > bound {bound:.3g}")


def synthetic_rows(seed: int, run_id: str, cases_per_group: int = 24,
                   scale: dict[tuple[str, str], float] | None = None,
                   bias: dict[tuple[str, str], float] | None = None) -> list[Row]:
    """A run's rows. `scale[(path, tensor)]` multiplies that group's errors, `bias[...]` adds to
    its mean_err: the plants of the drift tests."""
    rng = np.random.default_rng(seed)
    scale, bias = scale or {}, bias or {}
    rows = []
    for op, path, impl, tensors in LAYOUT:
        for i in range(cases_per_group):
            case_seed = int(rng.integers(0, 2**31))
            regime = REGIMES[i % len(REGIMES)]
            knobs = dict(
                topk=int(rng.choice([512, 1024, 2048])), heads=int(rng.choice([64, 128])),
                num_tokens=int(rng.integers(1, 512)),
                seq_len=int(rng.choice([200, 1500, 9000, 40000])),
                block_size=64, dcp_size=2 if path.endswith("dcp") else 1,
                cache_dtype="bfloat16" if path in ("bf16", "sparse_prefill") else "fp8_ds_mla",
                # the decode kernel rounds raw (non-pow2) scales to bf16: a documented deviation
                scale_rule="raw" if (op, impl, i % 3) == ("sparse_decode_fp8", "flash_mla", 0)
                else "pow2",
                value_regime=regime, sm_scale=576**-0.5,
            )
            deviation = DEVIATION if knobs["scale_rule"] == "raw" else ""
            base = Row(run_id=run_id, case_id=f"{path[:6]}{impl[:3]}{case_seed:08x}", op=op,
                       path=path, tensor="", impl=impl,
                       stages=(("attn", "flash_mla"), ("cache", "triton")) if impl == "pipeline" else (),
                       device="cpu", seed=case_seed, source="fuzz", deviation=deviation,
                       time_ref_s=float(rng.uniform(0.01, 0.2)),
                       time_impl_s=float(rng.uniform(0.001, 0.02)), **knobs)
            for tensor in tensors:
                s = scale.get((path, tensor), 1.0) * (4.0 if deviation else 1.0)
                b = bias.get((path, tensor), 0.0)
                numel = knobs["num_tokens"] * knobs["heads"] * (512 if tensor == "out" else 1)
                if tensor == "out":
                    rel = 2.0e-3 * s * float(rng.lognormal(0.0, 0.15))
                    rms = REGIME_RMS[regime] * float(rng.lognormal(0.0, 0.2))
                    row = changed(base, tensor=tensor, kind=tensor, numel=numel, ref_rms=rms, rel_l2=rel,
                                  cos_dist=rel**2 / 2, max_abs=rel * rms * 6, max_abs_at=(0, 3, 17),
                                  mismatch_frac=0.0, mean_err=float(rng.normal(0, 3e-6)) + b,
                                  bf16_units=rel / BF16_ROUNDING_REL_L2,
                                  elem_bf16_units=1.5 * s * float(rng.lognormal(0.0, 0.15)))
                    rows.append(_gated(row, "rel_l2", OUT_BOUND * (4.0 if deviation else 1.0)))
                elif tensor in ("lse", "max_logits"):
                    err = 1.0e-6 * s * float(rng.lognormal(0.0, 0.15))
                    row = changed(base, tensor=tensor, kind=tensor, numel=numel, ref_rms=9.0, rel_l2=err / 9,
                                  cos_dist=0.0, max_abs=err, max_abs_at=(5, 1), mismatch_frac=0.0,
                                  mean_err=float(rng.normal(0, 1e-8)) + b, lse_fp32_units=err / 2.5e-6)
                    rows.append(_gated(row, "max_abs", STAT_BOUND * (4.0 if deviation else 1.0)))
                else:
                    row = changed(base, tensor=tensor, kind="exact", numel=numel, mismatch_frac=0.0,
                                  max_abs=0.0)
                    rows.append(_gated(row, "mismatch_frac", 0.0))
    return rows


def with_failure(rows: list[Row]) -> tuple[list[Row], Row]:
    """The rows with one sparse_prefill out row pushed over its bound, its case the run's saved finding."""
    i = next(i for i, r in enumerate(rows) if r.path == "sparse_prefill" and r.tensor == "out")
    failed = _gated(changed(rows[i], rel_l2=0.05, bf16_units=30.0), "rel_l2", OUT_BOUND)
    failed.finding = f"sparse_prefill-flash_mla-{failed.case_id}.json"
    return [*rows[:i], failed, *rows[i + 1:]], failed


def _meta(seed: int) -> dict:
    return finish_meta(collect_meta("ci", [seed], "cpu", command="mla-verify gate --device cpu",
                                    extra={"isolated": True}))  # as the gate records it


@pytest.fixture(scope="module")
def meta() -> dict:
    return _meta(1)


# ---------------------------------------------------------------- storage


_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0.0, -0.0, 2.0e-3, 1.0e-300, math.inf]))
_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)


@st.composite
def rows_strategy(draw) -> list[Row]:
    """Rows with every field type's edge: missing knobs, NaN/inf/-0.0, text with separators,
    quotes, newlines and the words CSV readers like to turn into NaN."""
    out = []
    for _ in range(draw(st.integers(0, 6))):
        out.append(Row(
            run_id=draw(st.sampled_from(["r1", "run,2"])), case_id=draw(_text), op="forward_mqa",
            path=draw(st.sampled_from(["bf16", "fp8_mixed"])),
            tensor=draw(st.sampled_from(["out", "NA"])),
            impl="pipeline", stages=tuple(draw(st.lists(st.tuples(_text, _text), max_size=3))), device="cpu",
            seed=draw(st.integers(-(2**63), 2**63 - 1)), source="fuzz",
            topk=draw(st.none() | st.integers(0, 2**31)), heads=draw(st.none() | st.just(64)),
            value_regime=draw(st.none() | st.sampled_from(["normal", "nan", "None", ""])),
            sm_scale=draw(st.none() | _floats), kind=draw(st.sampled_from(["", *KINDS])),
            metrics=Metrics(numel=draw(st.integers(0, 2**40)), rel_l2=draw(_floats), mean_err=draw(_floats),
                            max_abs_at=tuple(draw(st.lists(st.integers(0, 2**62), max_size=4)))),
            headroom=draw(_floats),
            passed=draw(st.booleans()), reason=draw(_text | st.sampled_from(["NA", "nan", "a\nb"])),
        ))
    return out


@settings(max_examples=25, deadline=None)
@given(rows=rows_strategy())
def test_write_load_round_trip_preserves_columns_dtypes_values(tmp_path_factory, rows):
    run_dir = tmp_path_factory.mktemp("run")
    expected = rows_frame(rows)
    write_run(run_dir, rows, {"profile": "ci"})
    loaded, meta = load_run(run_dir)
    assert tuple(loaded.columns) == COLUMNS
    assert {c: str(loaded[c].dtype) for c in COLUMNS} == {c: SCHEMA[c][0] for c in COLUMNS}
    pd.testing.assert_frame_equal(loaded, expected)
    assert meta["profile"] == "ci" and meta["rows"] == len(rows)
    # rows.csv alone (a run copied around as text) loads to the same frame
    (run_dir / ROWS_PARQUET).unlink()
    pd.testing.assert_frame_equal(load_run(run_dir)[0], expected)
    assert (run_dir / "rows.csv").read_text().splitlines()[0] == ",".join(COLUMNS)


def test_rows_arrive_as_row_objects_or_dicts(tmp_path):
    rows = synthetic_rows(seed=3, run_id="r", cases_per_group=2)
    from_dicts = rows_frame([r.to_record() for r in rows])
    pd.testing.assert_frame_equal(rows_frame(rows), from_dicts)
    assert from_dicts["topk"].dtype == "Int64" and from_dicts["seed"].dtype == "int64"
    assert from_dicts.loc[from_dicts["tensor"] == "cache_bytes", "headroom"].eq(math.inf).all()


# tensor -> its rows' kind, every way a tensor is named: a DCP rank's, a partial, a property's
# "CHECK.TENSOR" (compared bitwise or not), a tensor of no check
NAMED_KINDS = {"out": "out", "lse": "lse", "max_logits": "max_logits", "indices": "exact", "weights": "other",
               "out_rank1": "out", "partial_out_rank0": "out", "lse_rank1": "lse", "partial_lse_rank0": "lse",
               "wider_k.out": "out", "rerun.max_logits": "max_logits", "rerun.lse": "exact", "*": "", "input:kv": ""}


def test_a_run_stored_before_rows_had_a_kind_loads_with_the_same_kinds(tmp_path):
    base = synthetic_rows(seed=4, run_id="r", cases_per_group=1)[0]
    rows = [replace(base, tensor=tensor, kind=kind) for tensor, kind in NAMED_KINDS.items()]
    new = write_run(tmp_path / "new", rows, {})
    loaded = load_run(new)[0]
    assert dict(zip(loaded["tensor"], loaded["kind"])) == NAMED_KINDS
    # the same run as it was stored before: no kind column (rows.parquet, rows.csv or a journal alone)
    old = {name: tmp_path / name for name in ("parquet", "csv", "journal")}
    for path in old.values():
        path.mkdir()
    loaded.drop(columns="kind").to_parquet(old["parquet"] / ROWS_PARQUET, index=False)
    text = pd.read_csv(new / "rows.csv", dtype=str, keep_default_na=False)
    (old["csv"] / "rows.csv").write_text(text.drop(columns="kind").to_csv(index=False))
    records = [{k: v for k, v in r.to_record().items() if k != "kind"} for r in rows]
    (old["journal"] / JOURNAL).write_text("".join(json.dumps(r) + "\n" for r in records))
    for path in old.values():
        pd.testing.assert_frame_equal(load_run(path)[0], loaded)
    assert list(annotate(loaded)["kind"]) == [kind or "other" for kind in NAMED_KINDS.values()]


def _strided_concat(ql_nope, q_pe):
    """concat_mla_q with the right values in a wider buffer: the contract asks for a dense q."""
    return torch.cat([ql_nope, q_pe, q_pe], dim=-1)[..., :576]


def _raises(ql_nope, q_pe):
    raise RuntimeError("no kernel here")


def test_rows_that_fail_before_a_comparison_take_their_checks_kind():
    from mla_verify import api

    contract = api.check("concat_mla_q", _strided_concat, examples=1, seed=1, device="cpu", shrink=False).rows
    assert contract[["tensor", "gate_metric", "kind", "exact"]].values.tolist() == [["q", "contract", "exact", True]]
    raised = api.check("concat_mla_q", _raises, examples=1, seed=1, device="cpu", shrink=False).rows
    assert raised[["tensor", "gate_metric", "kind", "exact"]].values.tolist() == [["*", "raised", "", False]]


def test_a_row_is_its_record_and_knows_its_kinds():
    row = changed(synthetic_rows(seed=5, run_id="r", cases_per_group=1)[0], mean_err=1e-3, rows=7)
    record = row.to_record()
    assert tuple(record) == COLUMNS and "rows" not in record and record["mean_err"] == 1e-3
    assert Row.from_record(record) == changed(row, rows=0)   # the oracle's own fields are not stored
    assert replace(row, kind="exact").exact and not replace(row, kind="out").exact
    with pytest.raises(ValueError, match="row kind 'partial_out' is none of"):
        replace(row, kind="partial_out")


def test_collect_meta_records_versions_device_git_and_times():
    meta = collect_meta("ci", [7, 8], "cpu", command=["mla-verify", "gate"], extra={"k": 1})
    assert meta["versions"]["python"] and meta["versions"]["pandas"] == pd.__version__
    assert meta["versions"]["torch"] is not None
    assert "flash_mla" in meta["versions"]          # None on a machine without the wheel
    assert meta["device_name"] and meta["seeds"] == [7, 8] and meta["command"] == "mla-verify gate"
    assert re.fullmatch(r"[0-9a-f]{40}", meta["git"]["revision"] or "")   # tests run in a checkout
    assert isinstance(meta["git"]["dirty"], bool)
    done = finish_meta(meta)
    assert done["finished_at"] >= meta["started_at"] and done["duration_s"] >= 0
    assert meta["finished_at"] is None and meta["extra"] == {"k": 1}


def test_a_tree_without_git_takes_its_revision_from_the_environment(monkeypatch):
    from mla_verify.reports import meta as meta_module

    monkeypatch.setattr(meta_module, "_git", lambda *args: None)
    monkeypatch.delenv("MLA_VERIFY_REVISION", raising=False)
    assert meta_module.git_state() == {"revision": None, "dirty": None}
    monkeypatch.setenv("MLA_VERIFY_REVISION", "29d8f84")
    assert meta_module.git_state() == {"revision": "29d8f84", "dirty": None}


# ---------------------------------------------------------------- drift (more in test_drift.py)


def _frame(seed: int, **plants) -> pd.DataFrame:
    return rows_frame(synthetic_rows(seed, run_id=f"s{seed}", **plants))


@pytest.fixture(scope="module")
def baseline() -> pd.DataFrame:
    return _frame(100)


# ---------------------------------------------------------------- run_report and renderings


def test_run_report_exit_codes(tmp_path, meta, capsys):
    def run(name: str, seed: int, plant=lambda rows: rows, **scale):
        rows = plant(synthetic_rows(seed, name, cases_per_group=8, **scale))
        return write_run(tmp_path / name, rows, meta)

    base_dir, same_dir = run("base", 110), run("same", 111)
    bad_dir = run("bad", 112, plant=lambda rows: with_failure(rows)[0],
                  scale={("fp8_mixed", "out"): 5.0})

    assert run_report(same_dir, baseline=base_dir) == 0
    out = capsys.readouterr().out
    assert "no drift" in out and "PASS" in out and (same_dir / "report.html").exists()

    md, html = tmp_path / "bad.md", tmp_path / "bad.html"
    saved = []   # the caller saves the case that drifted most (mla_verify.api.save_worst_case)
    assert run_report(bad_dir, baseline=base_dir, html=html, markdown=md,
                      save_case=lambda worst, directory, *declared: saved.append((worst, directory)) or "REPLAY IT") == 1
    out = capsys.readouterr().out
    assert [d for _, d in saved] == [bad_dir / "drift"] and f"drifted most: case {saved[0][0].case_id}" in out
    assert "REPLAY IT" in out and "REPLAY IT" in md.read_text()
    assert "FAIL: 1 finding in failures/: 1 of" in out and "DRIFT forward_mqa/fp8_mixed out [pipeline]: bf16_units p99" in out
    assert "NEW FAILURES sparse_prefill out [flash_mla]" in out      # the new failure's group
    assert "**drift** forward_mqa/fp8_mixed out [pipeline]" in md.read_text()
    assert html.exists() and not (bad_dir / "report.html").exists()


def test_exit_code_is_failures_or_drift(baseline, meta):
    failing, _ = with_failure(synthetic_rows(113, "fail"))
    assert build_report(rows_frame(failing), meta).exit_code == 1
    assert build_report(rows_frame(failing), meta, (baseline, meta)).exit_code == 1
    passing = rows_frame(synthetic_rows(114, "ok"))
    assert build_report(passing, meta, (baseline, meta)).exit_code == 0
    drifting = rows_frame(synthetic_rows(115, "drift", bias={("bf16", "out"): 5e-4}))
    assert build_report(drifting, meta, (baseline, meta)).exit_code == 1


@pytest.fixture(scope="module")
def failing_report(meta, baseline):
    rows, failed = with_failure(synthetic_rows(120, "r120"))
    report = build_report(rows_frame(rows), meta, (baseline, _meta(100)))
    return report, failed


def test_html_is_self_contained_and_shows_paths_failure_and_plots(failing_report, tmp_path):
    report, failed = failing_report
    page = render_html(report)
    (tmp_path / "report.html").write_text(page)
    assert "http://" not in page and "https://" not in page
    assert "<script" not in page and "<link" not in page
    srcs = re.findall(r'src="([^"]*)"', page)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert all(h.startswith("#") for h in re.findall(r'href="([^"]*)"', page))
    for path in PATHS:
        assert path in page
    assert failed.case_id in page and DEVIATION in page
    keys = re.findall(r'<figure id="([^"]+)"><img', page)
    assert keys == ["plot-path", "plot-lse", "plot-headroom", "plot-drift", "plot-topk", "plot-magnitude"]
    assert len(srcs) == len(keys)
    for src in srcs:
        assert base64.b64decode(src.split(",", 1)[1]).startswith(b"\x89PNG\r\n\x1a\n")
    for title in ("Failures", "Drift against the baseline", "Drift per metric", "Runs side by side", "Error per path",
                  "Documented deviations", "Error by topk"):
        assert f"<h2>{title}</h2>" in page


def test_markdown_has_the_html_tables(failing_report):
    report, failed = failing_report
    md = render_markdown(report)
    assert "http" not in md and "data:" not in md
    for section in report.sections:
        assert f"### {section.title}" in md
    assert failed.case_id in md and "FAIL: 1 finding in failures/: 1 of" in md
    table_lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert table_lines and all(ln.endswith("|") for ln in table_lines)


def test_terminal_summary_is_short_and_names_every_path(failing_report, meta):
    report, failed = failing_report
    text = terminal_summary(report.rows, meta)
    print(text)
    lines = text.splitlines()
    assert len(lines) <= 25
    for path in PATHS:
        assert any(ln.startswith(path + " ") for ln in lines), path
    assert lines[-1].startswith("FAIL: 1 finding in failures/: 1 of")
    assert f"{DEVIATION} (" in text
    prefill = next(ln for ln in lines if ln.startswith("sparse_prefill "))
    assert "out rel_l2 5.00e-02 / 1.56e-02" in prefill


def test_tables_handle_nan_inf_and_empty_runs(meta):
    rows = synthetic_rows(130, "r130", cases_per_group=3)
    rows[0] = changed(rows[0], rel_l2=math.nan, value=math.nan, headroom=math.nan, passed=False,
                      reason="NaN in output", nan_count=5)
    rows[2] = changed(rows[2], rel_l2=math.inf, value=math.inf, headroom=0.0, passed=False)
    report = build_report(rows_frame(rows), meta)
    groups = next(s.table for s in report.sections if s.key == "groups")
    bf16_out = groups[(groups["path"] == rows[0].path) & (groups["tensor"] == "out")].iloc[0]
    assert bf16_out["max"] == math.inf and bf16_out["failed"] == 2
    assert "| inf |" in render_markdown(report) and report.exit_code == 1
    # log axes: exact zeros sit on a floor line, inf on a ceiling line, NaN is left out; all counted
    lse = [i for i, r in enumerate(rows) if r.tensor == "lse"]
    rows[lse[0]] = changed(rows[lse[0]], max_abs=0.0)
    rows[lse[1]] = changed(rows[lse[1]], max_abs=math.inf)
    caption = error_by_path(annotate(rows_frame(rows))).caption
    assert re.search(r"lse max_abs: 1 zero values \(or below 1e-\d\d\) drawn at the floor 1e-\d\d; "
                     r"1 inf drawn at the ceiling 1e-\d\d\.", caption)
    assert re.search(r"out rel_l2: 1 inf drawn at the ceiling 1e[-+]\d\d; 1 NaN not drawn\.",
                     caption)
    empty = build_report(rows_frame([]), meta)
    assert empty.exit_code == 0 and "PASS: 0 rows" in render_html(empty)
    unrecorded = build_report(rows_frame([]), {k: v for k, v in meta.items() if k != "extra"})
    assert unrecorded.counts.line().startswith("PASS (isolation not recorded: maybe judged in the kernel's own process): 0 rows")
    assert figures(empty.rows) == []
