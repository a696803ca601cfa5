"""Drift words and history (issue 39): a decode kernel that rounds its softmax weights to bf16 before
P.V (tests.impls.decode_versions:v2) reads `worse` against its v1 with the numbers behind the word,
a reseeded v1 `unchanged`, a kernel beyond the factor (v3) `drifted` with exit 1; `--fail-on worse`;
the history of 10 runs of the three versions marks the steps the two-run judge calls worse or
drifted, links their worst cases to case files, and its page fits 1400 px.

Five real CPU campaigns of 40 decode cases (module fixture, ~30 s): v1 at seed 7 twice, v1 at seed
8, v2 and v3 at v1's seed. The history's other five runs are copies of these directories: a rerun
of these kernels on one seed writes the same rows (asserted on v1's two real runs).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest

from mla_verify import api
from mla_verify.cli import main
from mla_verify.fuzz import casefile
from mla_verify.bench.history_bench import write_runs
from mla_verify.reports import build_report, render_html
from mla_verify.reports.drift import GROUP_COLUMNS, PAIRED, UNPAIRED
from mla_verify.reports.glance import COLUMNS
from mla_verify.reports.history import history
from mla_verify.reports.history_html import render_history
from mla_verify.reports.words import sign_p
from tests.test_report_html import _MEASURE, CHROMIUM, VIEWPORT, Page

KERNEL = "tests.impls.decode_versions"
OP, SEED, CASES = "sparse_decode_fp8", 7, 40


def _check(version: str, out, seed: int | None = None, baseline=None):
    if baseline is not None:
        return api.check(OP, f"{KERNEL}:{version}", device="cpu", baseline=baseline, out=out)
    return api.check(OP, f"{KERNEL}:{version}", examples=CASES, seed=seed, device="cpu", profile="ci", out=out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("words")
    made = {"v1": _check("v1", root / "v1", SEED)}
    made["v1_again"] = _check("v1", root / "v1_again", SEED)
    made["v1_reseeded"] = _check("v1", root / "v1_reseeded", SEED + 1)
    made["v2"] = _check("v2", root / "v2", baseline=made["v1"].out)
    made["v3"] = _check("v3", root / "v3", baseline=made["v1"].out)
    # v1 and v2 inside every bound (v2 worse, not wrong); v3, truncating every weight toward zero, is
    # biased past the out bound on one of v1's covering cases as well as beyond the factor
    assert all(made[name].passed for name in ("v1", "v1_again", "v1_reseeded", "v2")) and not made["v3"].passed
    return {name: r.out for name, r in made.items()}


def _group(drift, tensor: str):
    return drift.groups[drift.groups["tensor"] == tensor].iloc[0]


def test_the_sign_test_is_the_binomial_tail():
    assert sign_p(0, 0) == 1.0 and sign_p(15, 0) == pytest.approx(2.0**-15)
    assert sign_p(3, 3) == pytest.approx(42 / 64) and sign_p(0, 5) == 1.0


def test_rounding_p_to_bf16_reads_worse_with_the_numbers_behind_it(runs, capsys):
    drift = api.drift(runs["v2"], runs["v1"])
    out, lse = _group(drift, "out"), _group(drift, "lse")
    assert (out["word"], out["mode"], lse["word"]) == ("worse", PAIRED, "unchanged") and out["paired_cases"] >= CASES - 1
    assert drift.exit_code == 0 and not drift.drifted                 # worse never fails by default
    units = drift.metrics[(drift.metrics["tensor"] == "out") & (drift.metrics["metric"] == "bf16_units")].iloc[0]
    assert units["finding"] == "worse" and units["ratio"] >= 1.0        # the median case moves up, if at all
    assert units["moved_up"] >= 10 and units["moved_down"] == 0 and units["p_moved"] < 0.01
    line = next(ln for ln in drift.lines() if ln.startswith("  worse: "))
    print(line)
    # the tail moves most: on drawn cases the median barely moved (x1.0x); the covering set's flat rows
    # of hundreds of keys, where bf16 weights lose most, move it too (seed 7: p99 x1.75, median x1.29)
    tail, median = re.match(r"  worse: out bf16_units p99 1 -> \d+\.\d+ \(x(\d+\.\d+)\), median x(\d+(?:\.\d+)?), "
                            r"(?:.*, )?abs_bias p90 x\d", line).groups()
    assert float(tail) > float(median) and float(median) == pytest.approx(units["ratio"], abs=0.01)
    assert drift.verdict.startswith("WORSE in 1 group within the factor, 2 compared (2 paired, 0 unpaired; 1 worse, 1 unchanged")
    assert api.drift(runs["v2"], runs["v1"], fail_on="worse").exit_code == 1
    report = build_report(*api.load_run(runs["v2"]), api.load_run(runs["v1"]))
    glance = report.sections[0].table
    assert glance["vs baseline"].iloc[0].startswith("worse: out bf16_units p99 1 -> ")   # first, at a glance
    assert main(["report", str(runs["v2"]), "--baseline", str(runs["v1"])]) == 0
    assert "  worse: out bf16_units p99 1 -> " in capsys.readouterr().out
    assert main(["report", str(runs["v2"]), "--baseline", str(runs["v1"]), "--fail-on", "worse"]) == 1


def test_a_rerun_and_a_reseeded_v1_read_unchanged(runs):
    again, reseeded = api.drift(runs["v1_again"], runs["v1"]), api.drift(runs["v1_reseeded"], runs["v1"])
    assert (again.groups["mode"] == PAIRED).all() and (again.groups["paired_cases"] >= 38).all()
    # another seed meets v1 again only on the first examples Hypothesis draws (a few); without them, unpaired
    assert (reseeded.groups["paired_cases"] < reseeded.groups["cur_cases"] / 4).all()
    base = api.load_run(runs["v1"])[0]
    other = api.load_run(runs["v1_reseeded"])[0]
    unpaired = api.drift(other[~other["case_id"].isin(base["case_id"])], base)
    assert (unpaired.groups["mode"] == UNPAIRED).all() and unpaired.metrics["p_moved"].notna().any()
    for drift in (again, reseeded, unpaired):
        assert (drift.groups["word"] == "unchanged").all(), drift.lines()
        assert drift.exit_code == 0 and api.drift(runs["v1_again"], runs["v1"], fail_on="worse").exit_code == 0
    judged = again.metrics[again.metrics["ratio"].notna()]
    assert (judged["ratio"] == 1.0).all() and (judged["moved_up"] == 0).all()
    # a rerun on one seed writes the same rows: what lets the history below copy run directories
    a, b = api.load_run(runs["v1"])[0], api.load_run(runs["v1_again"])[0]
    columns = ["case_id", "tensor", "bf16_units", "mean_err", "gain", "headroom"]
    assert a[columns].equals(b[columns])


def test_a_kernel_beyond_the_factor_reads_drifted_and_fails(runs, capsys):
    drift = api.drift(runs["v3"], runs["v1"])
    out = _group(drift, "out")
    assert out["word"] == "drifted" and "drift" in out["finding"].split(", ") and drift.exit_code == 1
    abs_bias = drift.metrics[(drift.metrics["tensor"] == "out") & (drift.metrics["metric"] == "abs_bias")].iloc[0]
    assert abs_bias["finding"] == "drift" and abs_bias["ratio"] > drift.factor
    assert main(["report", str(runs["v3"]), "--baseline", str(runs["v1"])]) == 1
    assert "  drifted: out abs_bias p99 " in capsys.readouterr().out


def test_the_drift_tables_show_few_columns_and_keep_the_rest_behind_details(runs):
    page = render_html(build_report(*api.load_run(runs["v2"]), api.load_run(runs["v1"])))
    section = re.search(r'<section id="drift">.*?</section>', page, re.S).group(0)
    first, rest = section.split("<details>", 1)
    assert first.count("<th>") <= 10 and "<td>worse</td>" in first
    assert rest.split("</table>")[0].count("<th>") == len(GROUP_COLUMNS)     # every column, one click away
    metrics = re.search(r'<section id="drift-metrics">.*?</section>', page, re.S).group(0)
    assert metrics.split("<details>")[0].count("<th>") <= 13
    assert Page(page).section("glance")["head"] == list(COLUMNS)


# ---------------------------------------------------------------- history


TEN = ("v1", "v1_again", "v1_reseeded", "v1+", "v2", "v2+", "v2++", "v3", "v3+", "v1++")


@pytest.fixture(scope="module")
def ten(runs, tmp_path_factory):
    """10 runs of three versions in order: v1 four times (one reseeded), v2 three, v3 two, then v1."""
    root = tmp_path_factory.mktemp("ten")
    dirs = []
    for i, name in enumerate(TEN):
        target = root / f"{i:02d}-{name}"
        shutil.copytree(runs[name.rstrip("+")], target, ignore=shutil.ignore_patterns("drift", "report.html"))
        meta = json.loads((target / "meta.json").read_text())
        meta["finished_at"] = f"2026-01-{i + 1:02d}T00:00:00+00:00"    # one a day, as nightly runs
        (target / "meta.json").write_text(json.dumps(meta))
        dirs.append(target)
    return dirs[::-1]   # given newest first: ordered by time


def test_history_marks_the_steps_the_two_run_judge_marks(ten):
    h = history(ten)
    assert list(h.runs["label"]) == sorted(p.name for p in ten)      # by time
    out = h.steps[h.steps["tensor"] == "out"]
    assert list(out["word"]) == ["unchanged"] * 3 + ["worse", "unchanged", "unchanged", "drifted", "unchanged", "better"]
    assert (out["cases"].iloc[[1, 2]] < 10).all() and (out["cases"].drop(out.index[[1, 2]]) >= 38).all()  # the reseeded run
    assert (h.steps[h.steps["tensor"] == "lse"]["word"] == "unchanged").all()
    for _, s in h.steps.iterrows():                                 # the words of `report NEW --baseline OLD`
        d = api.drift(h.runs["dir"].iloc[s["run"]], h.runs["dir"].iloc[s["before"]])
        assert _group(d, s["tensor"])["word"] == s["word"], (s["run"], s["tensor"])
    marked = [(h.label(s["run"]), s["word"]) for _, s in h.marked.iterrows()]
    assert marked == [("04-v2", "worse"), ("07-v3", "drifted")]
    trend = h.trend[h.trend["tensor"] == "out"]
    assert len(trend) == 10 and (trend["cases"] >= 38).all()
    assert trend["bf16_units p99"].iloc[4] > 1.5 * trend["bf16_units p99"].iloc[3]   # the tail v2 grew
    assert h.exit_code == 0                                          # the newest step: back to v1, better
    assert history(ten[2:]).exit_code == 1                           # ending on v3's first run: its step drifted
    print("\n".join(h.lines()))


class _Links(HTMLParser):
    def __init__(self, text: str):
        super().__init__()
        self.links, self.sections = [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "a" and "href" in attrs:
            self.links.append((attrs["href"], attrs.get("title", "")))
        elif tag == "section":
            self.sections.append(attrs["id"])


def test_the_history_page_links_the_worst_cases_and_fits_1400_px(ten, tmp_path, capsys):
    html = tmp_path / "history.html"
    assert main(["history", *map(str, ten), "--html", str(html)]) == 0
    printed = capsys.readouterr().out
    assert "history of 10 runs (00-v1 .. 09-v1++): 2 lines, 18 steps judged" in printed
    assert "  worse at 04-v2 (after 03-v1+): out bf16_units p99 1 -> " in printed
    page = html.read_text()
    dom = _Links(page)
    assert dom.sections[:2] == ["marked", "runs"] and len(dom.sections) == 4
    assert len(dom.links) == 2
    for href, title in dom.links:                                   # each worst case: a case file that replays
        saved = casefile.load(html.parent / href)
        assert saved.case.op == OP and title.startswith("mla-verify replay ") and href in title
    step = Page(page).section("line-1")                             # the out line's trend, run by run
    assert len(step["head"]) <= 10 and [r[1] for r in step["rows"][:10]][4] == "worse"
    if CHROMIUM is None:
        pytest.skip("no headless Chromium here (apt-get install chromium): the DOM checks above ran")
    shown = tmp_path / "measured.html"
    shown.write_text(page.replace("</body>", _MEASURE + "</body>"))
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={VIEWPORT},2000",
                          "--virtual-time-budget=5000", "--dump-dom", shown.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    overflow = dict(w.split("=") for w in re.search(r'<pre id="measured">(.*?)</pre>', dom).group(1).split())
    assert set(overflow) == set(_Links(page).sections) and all(int(v) <= 0 for v in overflow.values()), overflow
    png = tmp_path / "history.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={VIEWPORT},1400", f"--screenshot={png}", html.as_uri()], capture_output=True, timeout=120)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_the_history_benchmark_plants_a_worse_and_a_drifted_step(tmp_path):
    h = history(write_runs(tmp_path, runs=6, rows=2500))   # 100 cases a line: the 1.6x tenth is 10
    marked = {(h.label(s["run"]), s["word"]) for _, s in h.marked.iterrows()}
    assert marked == {("r003", "worse"), ("r004", "drifted")}
    assert np.isin(h.steps["word"], ["unchanged", "worse", "drifted"]).all()


def test_history_orders_by_revision_and_refuses_what_it_cannot_order(runs, tmp_path, capsys):
    dirs = []
    for name, revision in (("a", "aaa111"), ("b", "bbb222"), ("c", "ccc333")):
        shutil.copytree(runs["v1"], tmp_path / name, ignore=shutil.ignore_patterns("drift", "report.html"))
        meta = json.loads((tmp_path / name / "meta.json").read_text())
        meta["git"] = {"revision": revision, "dirty": False}
        (tmp_path / name / "meta.json").write_text(json.dumps(meta))
        dirs.append(str(tmp_path / name))
    assert list(api.history(dirs, order=["ccc", "aaa", "bbb"]).runs["label"]) == ["c", "a", "b"]
    assert main(["history", *dirs, "--revisions", "ccc,aaa"]) == 2
    assert "its revision bbb222 is in no revision of the order given" in capsys.readouterr().err
    assert main(["history", dirs[0]]) == 2
    assert "a history needs 2 runs or more" in capsys.readouterr().err


def _first_cases(run, n: int, target):
    """A copy of `run` holding its first `n` cases only: a smaller draw of the same seed."""
    import pandas as pd

    rows = pd.read_parquet(run / "rows.parquet")
    keep = rows["case_id"].drop_duplicates().iloc[:n]
    target.mkdir()
    rows[rows["case_id"].isin(keep)].to_parquet(target / "rows.parquet")
    shutil.copy(run / "meta.json", target / "meta.json")
    return target


def test_a_tail_regression_after_a_reseeded_run_reads_worse_and_what_was_not_compared_says_so(runs, tmp_path):
    """Issue 50 item 3: v1, v1 reseeded (seed 8), v2 (seed 7). v2's step meets its neighbour on the few
    cases Hypothesis draws first at every seed; its other 38 cases are judged unpaired, and the tail test
    finds the tail v2 grew (before: `unchanged`, judged on the shared cases alone)."""
    from mla_verify.reports.history_plots import marks

    h = history([runs["v1"], runs["v1_reseeded"], runs["v2"]], order="given")
    out = h.steps[h.steps["tensor"] == "out"].set_index("run")
    assert list(out["word"]) == ["unchanged", "worse"] and (out["cases"] < 10).all(), out
    assert out.loc[2, "headline"].startswith("out bf16_units p99 1 -> ")
    assert [(h.label(s["run"]), s["word"]) for _, s in h.marked.iterrows()] == [("v2", "worse")]
    drift = api.drift(runs["v2"], runs["v1_reseeded"])              # the two-run report reads the same
    g = _group(drift, "out")
    assert (g["word"], g["mode"]) == ("worse", PAIRED) and "of one run only" in drift.explain(g), drift.lines()
    # the page: the trend table's step column and the figure's marks read the same words
    line = h.trend[h.trend["tensor"] == "out"]
    assert marks(h.steps[h.steps["tensor"] == "out"]) == {2: "worse"}
    assert [r[1] for r in Page(render_history(h)).section("line-1")["rows"][:3]] == ["", "unchanged", "worse"]
    assert line["bf16_units p99"].iloc[2] > 1.5 * line["bf16_units p99"].iloc[1]
    # 8 cases a run: the 6 of one run only are too few to compare tails, so the step is not comparable
    small = [_first_cases(runs[name], 8, tmp_path / name) for name in ("v1", "v1_reseeded")]
    h = history(small, order="given")
    step = h.steps[h.steps["tensor"] == "out"].iloc[0]
    assert step["word"] == "not comparable" and step["headline"].startswith("seeds differ: "), step
    assert "too few to compare their tails (the tail test needs 21 a side)" in step["headline"]
    assert marks(h.steps) == {1: "not comparable"} and any(ln.startswith("  not comparable: 2 steps") for ln in h.lines())
    drift = api.drift(*small[::-1])
    assert set(drift.groups["word"]) == {"not comparable"} and "2 not comparable" in drift.verdict
