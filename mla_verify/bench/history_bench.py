"""`mla-verify bench --only history`: how long `mla-verify history` takes to read many runs.

Writes RUNS synthetic run directories of ROWS rows each (rows.parquet and meta.json, off the clock): 25 lines of 200 cases, each case's error and bias stable from run to run up to a 2% jitter, so
that every step pairs case for case; one line gets worse at run RUNS / 2 and drifts at 3 RUNS / 4.
Then times reading them (`reports.history.load`), the trend, the judged steps, and the HTML page.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

RUNS, ROWS = 200, 5000
_LINES = [(op, path, tensor, kind) for op, path in (("forward_mqa", "bf16"), ("forward_mqa", "fp8_mixed"),
                                                    ("forward_mqa", "fp8_mixed_dcp"), ("sparse_prefill", "sparse_prefill"),
                                                    ("sparse_decode_fp8", "sparse_decode_fp8"))
          for tensor, kind in (("out", "out"), ("lse", "lse"), ("max_logits", "max_logits"),
                               ("out_rank0", "out"), ("lse_rank0", "lse"))]


def _run_rows(run: int, runs: int, cases: int, rng: np.random.Generator, base: np.ndarray,
              spread: float) -> pd.DataFrame:
    """One run's rows: every line's cases with their stable errors, jittered by `spread`; line 0's out
    is worse (a tenth of its cases up 1.6x) from run `runs // 2` and 3x from `3 * runs // 4`."""
    n = len(_LINES) * cases
    line = np.repeat(np.arange(len(_LINES)), cases)
    units = base * rng.lognormal(0.0, spread, n)
    hit = line == 0
    if run >= runs // 2:
        units[hit & (np.arange(n) % 10 == 0)] *= 1.6
    if run >= 3 * runs // 4:
        units[hit] *= 3.0
    out_like = np.array([_LINES[i][3] == "out" for i in line])
    jitter = rng.lognormal(0.0, spread, n)      # each case's statistics as stable as its error
    return pd.DataFrame({
        "run_id": f"r{run:03d}", "case_id": [f"c{i % cases:04d}" for i in range(n)],
        "op": [_LINES[i][0] for i in line], "path": [_LINES[i][1] for i in line],
        "tensor": [_LINES[i][2] for i in line], "kind": [_LINES[i][3] for i in line], "impl": "mykern",
        "stages": [()] * n, "device": "cpu", "seed": 1, "source": "fuzz", "passed": True,
        "bf16_units": np.where(out_like, units, np.nan), "elem_bf16_units": np.where(out_like, units * 0.8, np.nan),
        "lse_fp32_units": np.where(out_like, np.nan, units * 0.3),
        "mean_err": np.where(out_like, 2e-5, 5e-8) * (base - 1.0) * jitter,
        "gain": np.where(out_like, 3e-5 * (base - 1.0) * jitter, np.nan), "bias_units": 0.01 * (base - 1.0) * jitter,
        "headroom": 1.0 / (0.2 * units), "value": 0.2 * units, "bound": 1.0})


def write_runs(root: Path, runs: int = RUNS, rows: int = ROWS, spread: float = 0.02) -> list[Path]:
    """`runs` run directories of about `rows` rows each under `root`, one a minute apart; each case's
    values vary from run to run by a lognormal `spread` (0: a rerun writes the same values)."""
    from mla_verify.reports.store import META_JSON, ROWS_PARQUET, conform, write_parquet

    cases = rows // len(_LINES)
    rng = np.random.default_rng(1)
    base = rng.lognormal(0.0, 0.3, len(_LINES) * cases)
    out = []
    for run in range(runs):   # what write_run writes but rows.csv, which history never reads
        directory = root / f"r{run:03d}"
        directory.mkdir(parents=True)
        write_parquet(conform(_run_rows(run, runs, cases, rng, base, spread)), directory / ROWS_PARQUET)
        meta = {"profile": "ci", "seeds": [1], "device": "cpu", "finished_at": f"2026-01-01T{run // 60:02d}:{run % 60:02d}:00"}
        (directory / META_JSON).write_text(json.dumps(meta))
        out.append(directory)
    return out


def _timed(dirs: list[Path], page: bool) -> tuple[dict, object]:
    """Seconds of `history` whole, then of its pieces again (the files now in the page cache), and of the page."""
    from mla_verify.reports.history import history, load, ordered, steps, trend
    from mla_verify.reports.history_html import render_history

    clock = time.perf_counter()
    h = history(dirs)
    times = {"history": time.perf_counter() - clock}
    clock = time.perf_counter()
    frame = load(ordered(dirs))
    times["load"] = time.perf_counter() - clock
    for name, piece in (("trend", trend), ("steps", steps), ("page", lambda _: render_history(h))):
        if name != "page" or page:
            clock = time.perf_counter()
            piece(frame)
            times[name] = time.perf_counter() - clock
    return times, h


def bench_history(quick: bool) -> list[dict]:
    runs, rows = (20, 5000) if quick else (RUNS, ROWS)
    out = []
    for spread, what in ((0.02, "every case moves 2% a run"), (0.0, "reruns write the same values")):
        with tempfile.TemporaryDirectory() as tmp:
            times, h = _timed(write_runs(Path(tmp), runs, rows, spread), page=not out)
        page = f"; then the page {times['page']:.1f} s" if "page" in times else ""
        out.append({"kind": "history", "shape": f"{runs} runs x {rows} rows, {what}", "impl": "mla-verify history",
                    "ms": times["history"] * 1e3,
                    "ops_note": (f"of which load {times['load']:.2f} s, trend {times['trend']:.2f} s, steps "
                                 f"{times['steps']:.2f} s ({len(h.steps)} judged, {len(h.marked)} marked){page}")})
        print(json.dumps(out[-1]), flush=True)
    return out
