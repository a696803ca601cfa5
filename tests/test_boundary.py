"""The worker is untrusted (issue 35): data, not code, crosses to the judge; the parent owns every
verdict and the record. Each kernel of tests/hostile/boundary.py gets its outcome isolated (and in
process where the attack applies there), a saved case, and never a pass, exit 3 or lost rows."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mla_verify.equivalence.sandbox import wire
from mla_verify.equivalence.sandbox.produced import Produced
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.catalog import evaluate, resolve_subject
from mla_verify.equivalence.blocks import Judging
from tests.isolated import gone, judged
from tests.hostile import BOUNDARY
from tests.test_hostile import CASES, REPO, run, saved_case

QUANTIZE = Case("quantize_fp8_ds_mla", CASES["quantize_fp8_ds_mla"], 3)


@pytest.mark.parametrize("h", BOUNDARY, ids=[h.impl.split(":")[1] for h in BOUNDARY])
def test_each_boundary_kernel_fails_its_case_isolated(h):
    w = Judging("cpu", isolate=True, timeout=5.0)  # a worker of its own: a forged answer leaves the real one queued
    try:
        judged(w, QUANTIZE, ["torch-fp32"], "torch-fp32")  # started and warm: the clock is the case's
        start = time.monotonic()
        rows = judged(w, Case(h.op, CASES[h.op], 3), [h.impl], h.impl)
        took = time.monotonic() - start
    finally:
        w.close()
    failing = [(r.gate_metric, r.reason) for r in rows if not r.passed]
    assert rows and not all(r.passed for r in rows)
    assert any(metric == h.metric and h.says in reason for metric, reason in failing), failing
    assert took < 15.0, f"{took:.1f} s: the parent waited for the timeout instead of the worker's process"
    assert not Path("/tmp/mla-verify-pwned").exists()


@pytest.mark.parametrize("h", [h for h in BOUNDARY if not h.isolate], ids=lambda h: h.impl.split(":")[1])
def test_each_boundary_kernel_that_applies_in_process_fails_there_too(h):
    rows = evaluate(Case(h.op, CASES[h.op], 3), resolve_subject(h.op, [h.impl], "cpu"), "cpu")
    assert any(r.gate_metric == h.metric and h.says in r.reason for r in rows if not r.passed)


def test_a_forged_error_is_a_saved_crashed_finding_that_replays_never_exit_3(capsys, tmp_path):
    impl = "tests.hostile.boundary:forges_an_error"
    code, text = run(capsys, "fuzz", "--op", "quantize_fp8_ds_mla", "--impl", impl, "--examples", 2, "--seed", 1,
                     "--device", "cpu", "--profile", "ci", "--no-shrink", "--timeout", 20, "--out", tmp_path / "run")
    assert code == 1 and "Traceback" not in text and "after the implementation was called" in text
    case = saved_case(text)
    code, text = run(capsys, "replay", case, "--impl", impl, "--device", "cpu", "--timeout", 20)
    assert code == 1 and "after the implementation was called" in text


def test_a_pass_rests_on_a_message_the_parent_parsed_as_data(monkeypatch):
    """The isolated pass of a correct kernel: nothing is unpickled in the parent, every message
    went through the parser, and the row is the parent's verdict on the output it decoded."""
    import multiprocessing.connection
    import pickle
    from multiprocessing.reduction import ForkingPickler

    def refused(*args, **kwargs):
        raise AssertionError("the parent unpickled something")

    parsed = []
    read = wire.Reader.read
    monkeypatch.setattr(wire.Reader, "read", lambda self, deadline: parsed.append(1) or read(self, deadline))
    for owner, name in ((pickle, "loads"), (pickle, "load"), (ForkingPickler, "loads"),
                        (multiprocessing.connection.Connection, "recv")):
        monkeypatch.setattr(owner, name, refused)
    w = Judging("cpu", isolate=True, timeout=20.0)
    try:
        rows = judged(w, QUANTIZE, ["torch-fp32"], "torch-fp32")
    finally:
        w.close()
    assert rows and all(r.passed for r in rows) and {r.tensor for r in rows} == {"rows"}
    assert rows[0].gate_metric == "mismatch_frac" and rows[0].metrics.numel > 0  # judged here, values compared
    assert len(parsed) >= 3  # ready, calling, produced (and the after-return check)


@pytest.mark.parametrize("isolated", [False, True])
def test_a_call_that_leaves_a_thread_running_is_noted_on_its_rows(isolated):
    impl = "tests.hostile.boundary:leaves_a_thread"
    if isolated:
        w = Judging("cpu", isolate=True, timeout=20.0)
        try:
            rows = judged(w, QUANTIZE, [impl], impl)
        finally:
            w.close()
    else:
        rows = evaluate(QUANTIZE, resolve_subject(QUANTIZE.op, [impl], "cpu"), "cpu")
    assert rows and all(r.passed and "the call left 1 thread(s) running" in r.reason for r in rows)


def _reader_of(data: bytes) -> wire.Reader:
    r, w = os.pipe()
    os.write(w, data)
    os.close(w)
    never_r, _ = os.pipe()  # a worker that is alive
    return wire.Reader(r, never_r)


@pytest.mark.parametrize("frames, says", [
    ([b"\x80\x04\x95garbage"], "does not start as a message does"),
    ([wire._FRAME.pack(wire.MAGIC, 2**31)], "over the"),
    ([wire._FRAME.pack(wire.MAGIC, 5) + b"[1,2]"], "not a JSON object"),
    ([wire._FRAME.pack(wire.MAGIC, 9) + b"\xff\xfe{}xxxxx"], "not JSON"),
    (wire.encode({"kind": "produced"}, [torch.ones(3)])[:1], "closed mid-message"),
])
def test_the_parser_refuses_what_is_not_a_message(frames, says):
    with pytest.raises(wire.Unreadable, match=says):
        _reader_of(b"".join(bytes(f) for f in frames)).read(time.monotonic() + 5)


@pytest.mark.parametrize("spec, says", [
    ({"dtype": "object", "shape": [1], "device": "cpu", "nbytes": 8}, "dtype 'object' is not one of"),
    ({"dtype": "float32", "shape": [-1], "device": "cpu", "nbytes": 4}, "not a list of sizes"),
    ({"dtype": "float32", "shape": [2], "device": "cpu", "nbytes": 4}, "claims 4 bytes"),
    ({"dtype": "float32", "shape": [2], "device": "gpu0", "nbytes": 8}, "device 'gpu0'"),
    ({"dtype": "float32", "shape": [1] * 9, "device": "cpu", "nbytes": 4}, "not a list of at most 8"),
])
def test_a_tensor_description_is_checked_before_anything_is_allocated(spec, says):
    body = json.dumps({"kind": "produced", "tensors": [spec]}).encode()
    with pytest.raises(wire.Unreadable, match=says):
        _reader_of(wire._FRAME.pack(wire.MAGIC, len(body)) + body).read(time.monotonic() + 5)


def test_tensors_cross_bit_for_bit_in_every_dtype_and_as_meta():
    sent = [torch.randn(3, 5).to(d) for d in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float64)]
    sent += [torch.randint(0, 255, (7,), dtype=torch.uint8), torch.zeros(0, 4), torch.empty(2, 3, device="meta"),
             torch.randn(4, 6).t()]
    header, got = _reader_of(b"".join(bytes(f) for f in wire.encode({"kind": "x"}, sent))).read(time.monotonic() + 5)
    assert header["kind"] == "x" and len(got) == len(sent)
    for a, b in zip(sent, got):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
        if a.device.type != "meta":
            assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("stages, says", [
    ("convert_index=triton", "not a list"),
    ([["convert_index", "triton", "sparse_prefill"]], r"not \[stage, implementation\] pairs"),
    ([["convert_index", 3]], "not a list of strings"),
    ([["s" * 201, "triton"]], "over 200 characters"),
    ([["convert_index", "triton"]] * 5000, "not a list of at most"),
])
def test_a_pipelines_stages_cross_as_pairs_of_names(stages, says):
    header = {"tensors": [], "stages": [["convert_index", "torch-fp32"], ["sparse_prefill", "triton"]]}
    assert Produced.from_header(header, ()).stages == (("convert_index", "torch-fp32"), ("sparse_prefill", "triton"))
    with pytest.raises(wire.Unreadable, match=says):
        Produced.from_header({**header, "stages": stages}, ())


# ----------------------------------------------------------------------------- nothing outlives its case


def cli(*argv, env_extra: dict) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env_extra}
    return subprocess.Popen([sys.executable, "-m", "mla_verify.cli", *map(str, argv)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="child subreapers are Linux's")
def test_a_daemon_a_kernel_leaves_is_killed_when_its_case_ends(tmp_path):
    from tests.hostile.boundary import DAEMON

    proc = cli("fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.boundary:leaves_a_daemon",
               "--examples", 2, "--seed", 1, "--device", "cpu", "--profile", "ci", "--out", tmp_path / "run",
               env_extra={})
    text, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and f"daemon started: {DAEMON}" in text, text
    deadline = time.monotonic() + 5
    while _named(DAEMON) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _named(DAEMON), f"the daemon {_named(DAEMON)} outlived the run"


def _named(comm: str) -> list[int]:
    """The living processes called `comm` (zombies are gone)."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/comm") as f:
                if f.read().strip() == comm and not gone(int(name)):
                    found.append(int(name))
        except (OSError, ValueError):
            continue
    return found


def test_report_says_tampered_naming_what_changed_after_the_run(capsys, tmp_path):
    import pandas as pd

    done = tmp_path / "run"
    code, text = run(capsys, "fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.cpu:system_exit",
                     "--examples", 2, "--seed", 1, "--device", "cpu", "--profile", "ci", "--no-shrink", "--out", done)
    assert code == 1 and (done / "failures").is_dir()
    assert run(capsys, "report", done)[0] == 1 and "TAMPERED" not in run(capsys, "report", done)[1]
    frame = pd.read_parquet(done / "rows.parquet")
    frame.assign(passed=True).to_parquet(done / "rows.parquet")  # what the daemon of the issue did
    for f in (done / "failures").glob("*.json"):
        f.unlink()
    code, text = run(capsys, "report", done)
    assert code == 1 and "TAMPERED" in text and "rows.parquet changed" in text and "failures/" in text, text
    meta = json.loads((done / "meta.json").read_text())
    del meta["record"]  # a run written before records existed
    (done / "meta.json").write_text(json.dumps(meta))
    code, text = run(capsys, "report", done)
    assert "no digest recorded" in text and "TAMPERED" not in text


@pytest.mark.parametrize("out", ["/", "home"])
def test_out_is_ours_alone(capsys, tmp_path, out):
    where = Path("/") if out == "/" else tmp_path
    if out == "home":
        (tmp_path / "notes.txt").write_text("mine")
    fuzz = ["fuzz", "--op", "convert_index", "--examples", 1, "--device", "cpu", "--profile", "ci", "--out", where]
    code, text = run(capsys, *fuzz)
    assert code == 2 and "which no run writes" in text and len(text.strip().splitlines()) == 1
    assert not (where / "rows.csv").exists() and not (where / "meta.json").exists()
    from mla_verify import check
    from mla_verify.equivalence.errors import UsageError

    with pytest.raises(UsageError, match="which no run writes"):
        check("convert_index", examples=1, device="cpu", out=where)
