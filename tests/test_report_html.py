"""The HTML report at a glance (issue 29 item 8): it leads with what an engineer asks first (which
paths fail or sit closest to their bound, what changed against the baseline) in a table narrow
enough to read whole, the run's facts at the end with nothing empty among them. Checked on the
DOM (stdlib html.parser) everywhere, and laid out by headless Chromium at 1400 px where one is
installed (apt-get install chromium; skipped with the reason otherwise)."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest

from mla_verify.reports import build_report, render_html, rows_frame
from mla_verify.reports.glance import COLUMNS
from mla_verify.reports.plots import LogAxis
from tests.test_reports import _meta, changed, synthetic_rows, with_failure

VIEWPORT = 1400


class Page(HTMLParser):
    """The report's sections in order, each with its tables (header cells, then rows of cells),
    and the text of every table cell of the run's facts."""

    def __init__(self, text: str):
        super().__init__()
        self.sections: list[dict] = []
        self._cell: list[str] | None = None
        self._row: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.sections.append({"id": attrs["id"], "head": [], "rows": [], "classes": []})
        elif tag == "tr" and self.sections:
            self._row = []
            self.sections[-1]["classes"].append(attrs.get("class", ""))
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            s = self.sections[-1]
            if s["head"] or s["rows"] or s["id"] == "run":
                s["rows"].append(self._row)
            else:
                s["head"] = self._row
                s["classes"].pop()
            self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)

    def section(self, key: str) -> dict:
        return next(s for s in self.sections if s["id"] == key)


@pytest.fixture(scope="module")
def page() -> str:
    baseline = synthetic_rows(100, "r100")
    rows, _ = with_failure(synthetic_rows(120, "r120"))
    # a group that moved against the baseline: 3x its error, paired case for case
    rows = [changed(r, bf16_units=r.metrics.bf16_units * 3) if r.path == "fp8_mixed" and r.tensor == "out" else r
            for r in rows]
    meta = _meta(1)
    meta["extra"] = {"examples": None, "ops": None, "op": "forward_mqa"}
    return render_html(build_report(rows_frame(rows), meta, (rows_frame(baseline), _meta(100))))


def test_the_report_leads_with_the_paths_that_fail_or_sit_closest_to_their_bound(page):
    p = Page(page)
    assert [s["id"] for s in p.sections][:3] == ["glance", "failures", "groups"]
    glance = p.section("glance")
    assert glance["head"] == list(COLUMNS) and len(glance["head"]) <= 8
    status = [r[0] for r in glance["rows"]]
    assert status[0].startswith("FAIL 1 of") and all(s == "ok" for s in status[1:])
    assert glance["classes"][0] == "bad"
    use = [float(r[COLUMNS.index("bound use")].rstrip("%")) for r in glance["rows"]]
    failing, rest = use[:1], use[1:]
    assert failing[0] >= 100
    changed_rows = [r for r in glance["rows"] if r[COLUMNS.index("vs baseline")] not in ("unchanged", "not comparable", "")]
    assert changed_rows, "the group that drifted is named against the baseline"
    flagged = [i for i, r in enumerate(glance["rows"]) if r in changed_rows and "improved" not in r[-1]]
    unflagged = [i for i, r in enumerate(glance["rows"]) if i and r not in changed_rows]
    assert max(flagged) < min(unflagged)                   # what changed comes before the unchanged
    after = [use[i] for i in unflagged]
    assert after == sorted(after, reverse=True)            # then by the share of the bound used
    # the run's facts come last, with nothing empty among them
    assert p.sections[-1]["id"] == "run"
    facts = dict((r[0], r[1]) for r in p.section("run")["rows"])
    assert facts["op"] == "forward_mqa" and "extra" not in facts and "examples" not in facts
    assert not any(v in ("null", "None", "") for v in facts.values()), facts


def test_a_log_axis_never_stretches_over_an_exact_zero_or_a_tiny_value():
    axis = LogAxis.of([np.array([0.0, 1e-20, 1e-3, 2e-3, 1.0])])
    assert axis.floor >= 1e-7 and axis.ceiling == 10.0 and axis.zeros == 2
    assert list(axis.clip(np.array([0.0, 1e-20, 0.5]))) == [axis.floor, axis.floor, 0.5]


def test_a_failure_message_wraps_instead_of_widening_its_table(page):
    failing = re.search(r'<section id="failures">.*?</section>', page, re.S).group(0)
    assert '<td class="long">' in failing or all(len(t) <= 60 for t in re.findall(r"<td>([^<]*)</td>", failing))


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
_MEASURE = """<script>
addEventListener('load', () => {
  const widths = [...document.querySelectorAll('section')].map(s => {
    const d = s.querySelector('.scroll') || s.querySelector('table');
    return s.id + '=' + (d ? d.scrollWidth - d.clientWidth : 0); });
  const pre = document.createElement('pre'); pre.id = 'measured';
  pre.textContent = widths.join(' '); document.body.appendChild(pre); });
</script>"""


@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium here (apt-get install chromium): "
                                             "the DOM tests above check the report instead")
def test_at_1400_px_the_leading_tables_fit_the_window_without_scrolling(page, tmp_path):
    shown = tmp_path / "report.html"
    shown.write_text(page.replace("</body>", _MEASURE + "</body>"))
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={VIEWPORT},2000",
                          "--virtual-time-budget=5000", "--dump-dom", shown.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    overflow = dict(w.split("=") for w in re.search(r'<pre id="measured">(.*?)</pre>', dom).group(1).split())
    for key in ("glance", "failures", "groups", "drift", "drift-metrics", "run"):  # px a table would scroll by: none
        assert int(overflow[key]) <= 0, (key, overflow)
    png = tmp_path / "report.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={VIEWPORT},1400", f"--screenshot={png}", (tmp_path / "report.html").as_uri()],
                   capture_output=True, timeout=120)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
