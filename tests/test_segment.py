"""The shared segments between an isolation worker and its parent (issue 41): outputs come back
and inputs go out through sealed memfds the parent owns, the pipe carrying only the JSON header;
the parent parses the header with the bounds it always applied, copies each output out as the
answer arrives, and compares the inputs it handed over with its own after the call."""

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from mla_verify.equivalence.sandbox import segment, wire
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.blocks import Judging
from tests.isolated import judged
from tests.test_hostile import CASES

QUANTIZE = Case("quantize_fp8_ds_mla", CASES["quantize_fp8_ds_mla"], 3)
FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _message(tensors, out: segment.Segment | None):
    """`tensors` encoded by the worker's side into `out` (mapped as a worker maps it), read back by
    the parent's: (the header as sent, tensors, the bytes that went through the pipe)."""
    into = segment.Mapped(out.describe(), os.dup(out.fd)) if out is not None else None
    frames = wire.encode({"kind": "produced"}, tensors, into)
    data = b"".join(bytes(f) for f in frames)
    r, w = os.pipe()
    os.write(w, data)
    os.close(w)
    never, keep = os.pipe()
    try:
        _, got = wire.Reader(r, never, out).read(time.monotonic() + 5)
    finally:
        for fd in (r, never, keep):
            os.close(fd)
    _, length = wire._FRAME.unpack(data[:wire._FRAME.size])
    return json.loads(data[wire._FRAME.size:wire._FRAME.size + length]), got, data


def _sent() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    floats = [torch.randn(3, 5, generator=g, dtype=torch.float64).to(d) for d in FLOATS]
    return [*floats, torch.randn(16384, generator=g), torch.randn(4, 4, generator=g).t(), torch.randint(-9, 9, (7,), generator=g, dtype=torch.int32),
            torch.randn(8, generator=g).to(torch.float8_e4m3fn), torch.tensor([True, False]), torch.empty(0, 3),
            torch.empty(2, 2, device="meta")]


def test_outputs_cross_through_the_segment_bit_for_bit_with_only_the_header_in_the_pipe():
    out = segment.Segment.create(1 << 20, writable=False)
    assert out is not None, "this system cannot seal a memfd: the pipe carries everything"
    try:
        sent = _sent()
        header, got, data = _message(sent, out)
        payload = sum(t.numel() * t.element_size() for t in sent if t.device.type != "meta")
        assert payload > 65536 and len(data) < 4096  # the header only
        assert all("offset" in d for d in header["tensors"][:-1]) and "offset" not in header["tensors"][-1]
        for a, b in zip(sent, got):
            assert a.dtype == b.dtype and a.shape == b.shape and a.device.type == b.device.type
            if a.device.type != "meta":
                assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    finally:
        out.close()


def test_outputs_that_do_not_fit_the_segment_go_through_the_pipe():
    out = segment.Segment.create(64, writable=False)
    try:
        sent = [torch.randn(1000)]
        header, got, data = _message(sent, out)
        assert "offset" not in header["tensors"][0] and len(data) > 4000 and torch.equal(got[0], sent[0])
    finally:
        out.close()


def test_the_judge_reads_its_copy_taken_when_the_answer_arrived():
    out = segment.Segment.create(1 << 16, writable=False)
    try:
        sent = torch.randn(64, dtype=torch.float64)
        _, got, _ = _message([sent], out)
        scribbler = segment.Mapped(out.describe(), os.dup(out.fd))
        scribbler.view[:512] = b"\xff" * 512  # the worker writes again after answering
        assert bytes(out.view[:8]) == b"\xff" * 8 and torch.equal(got[0], sent) and not got[0].isnan().any()
        with pytest.raises(TypeError):  # the judge's own mapping of the outputs is read-only
            out.view[0] = 0
    finally:
        out.close()


def _forged(tensors: list[dict], out: segment.Segment | None) -> wire.Reader:
    body = json.dumps({"kind": "produced", "tensors": tensors}).encode()
    r, w = os.pipe()
    os.write(w, wire._FRAME.pack(wire.MAGIC, len(body)) + body)
    os.close(w)
    return wire.Reader(r, r, out)


def _at(offset, nbytes=16, **extra) -> dict:
    return {"dtype": "uint8", "shape": [nbytes], "device": "cpu", "nbytes": nbytes, "offset": offset, **extra}


@pytest.mark.parametrize("tensors, says", [
    ([_at(4096 - 8)], "ends past the shared segment's 4096 bytes"),
    ([_at(2**30)], "ends past the shared segment"),
    ([_at(2**40)], "is not a place in a shared segment"),
    ([_at(0), _at(8)], "two tensors overlap in the shared segment"),
    ([_at(32), _at(0, nbytes=48)], "two tensors overlap"),
    ([_at(-16)], "is not a place in a shared segment"),
    ([_at(True)], "is not a place"),
    ([_at("0")], "is not a place"),
    ([_at(0.0)], "is not a place"),
    ([{**_at(0), "device": "meta", "nbytes": 0}], "is not a place"),
    ([{**_at(0), "nbytes": 8}], "claims 8 bytes"),
])
def test_a_header_that_misplaces_outputs_in_the_segment_is_unreadable(tensors, says):
    out = segment.Segment.create(4096, writable=False)
    reader = _forged(tensors, out)
    try:
        with pytest.raises(wire.Unreadable, match=says):
            reader.read(time.monotonic() + 5)
    finally:
        os.close(reader.fd)
        out.close()


def test_outputs_placed_in_a_segment_never_given_are_unreadable():
    reader = _forged([_at(0)], None)
    try:
        with pytest.raises(wire.Unreadable, match="a shared segment it was not given"):
            reader.read(time.monotonic() + 5)
    finally:
        os.close(reader.fd)


def test_no_one_can_resize_a_segment_and_its_parent_mapping_stays_whole():
    seg = segment.Segment.create(4096, writable=True)
    try:
        fd = os.dup(seg.fd)  # as the worker holds it, handed over
        try:
            for size in (0, 1 << 20):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, size)
        finally:
            os.close(fd)
        with pytest.raises(OSError):
            os.unlink(f"/proc/self/fd/{seg.fd}")  # no name to unlink: the one path is /proc's
        seg.view[4095] = 7
        assert os.fstat(seg.fd).st_size == 4096 and seg.view[4095] == 7
    finally:
        seg.close()


def _strided_inputs(device: str = "cpu") -> dict:
    """Arguments of every kind, built on `device`: q and same are two views of one storage there."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 10, generator=g).to(torch.bfloat16).to(device)
    idx = torch.randint(0, 9, (4, 3), generator=g, dtype=torch.int32).to(device)
    return {"q": base[1:, 2:9], "same": base, "idx": idx.t(),
            "scale": -0.0, "n": 7, "rule": "pow2", "none": None, "flag": True, "nan": float("nan"),
            "lens": [3, 4], "pair": (torch.arange(4.0, dtype=torch.float64, device=device), 2)}


def test_inputs_handed_over_are_the_parents_as_built_views_offsets_and_shared_storages_kept():
    kwargs = _strided_inputs()
    seg, handed = segment.hand_over(kwargs, None)
    try:
        got = segment.inputs_of(handed.described, segment.Mapped(seg.describe(), os.dup(seg.fd)), "cpu")
        assert set(got) == set(kwargs) and len(handed.regions) == 3  # q and same share one storage
        for name in ("q", "same", "idx"):
            a, b = kwargs[name], got[name]
            assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset())
            assert torch.equal(a, b)
        assert got["q"].untyped_storage().data_ptr() == got["same"].untyped_storage().data_ptr()
        assert str(got["scale"]) == "-0.0" and got["nan"] != got["nan"]
        assert [got[k] for k in ("n", "rule", "none", "flag", "lens")] == [7, "pow2", None, True, [3, 4]]
        assert isinstance(got["pair"], tuple) and torch.equal(got["pair"][0], kwargs["pair"][0])
        assert segment.written(seg, handed, ()) == []
        got["q"][0, 0] = 1e4  # the kernel writes its input: on the segment, not on the parent's
        written = segment.written(seg, handed, ())
        assert [name for name, _ in written] == ["q"] and "differs from its own copy" in written[0][1]
        assert segment.written(seg, handed, ("same",)) == []  # an argument written in place by contract
        assert kwargs["q"][0, 0] != 1e4
    finally:
        seg.close()


@dataclass
class _Batch:  # as forward_mqa's Batch: an object holding tensors
    q: torch.Tensor


def test_inputs_that_are_not_plain_data_are_built_by_the_worker():
    assert segment.hand_over({"batch": _Batch(torch.ones(3)), "n": 1}, None) == (None, None)
    assert segment.hand_over({"x": torch.ones(3).to_sparse()}, None) == (None, None)


def test_an_isolated_case_hands_its_inputs_and_outputs_through_the_segments(monkeypatch):
    placed, handed = [], []
    regions, hand_over = wire._regions, segment.hand_over
    monkeypatch.setattr(wire, "_regions", lambda specs, seg: placed.append([s[-1] for s in specs]) or regions(specs, seg))
    monkeypatch.setattr(segment, "hand_over", lambda kw, seg: handed.append(hand_over(kw, seg)) or handed[-1])
    w = Judging("cpu", isolate=True, timeout=20.0)
    try:
        rows = judged(w, QUANTIZE, ["torch-fp32"], "torch-fp32")
    finally:
        w.close()
    assert rows and all(r.passed for r in rows) and rows[0].metrics.numel > 0
    assert len(handed) == 1 and set(handed[0][1].described["values"]) == {"kv", "scale_rule"}
    assert [offsets for offsets in placed if offsets] == [[0]]  # the answer's one output, in the segment


def test_a_worker_whose_segment_descriptors_do_not_come_falls_back_to_the_pipe_and_its_own_inputs(monkeypatch):
    """Descriptors that do not arrive (here: the marker byte sent without them) cost the segments,
    not the case: outputs come through the pipe, the worker builds the inputs."""
    r, w = socket.socketpair()
    try:
        handles = segment.Handles(w.fileno())
        socket.send_fds(r, [b"S"], [])
        handles.receive([1])
        assert segment.mapping(None, {"size": 4096, "serial": 1}, handles) is None
    finally:
        r.close()
        w.close()
    placed = []
    monkeypatch.setattr(segment, "send_handles", lambda sock, segments: segments and socket.send_fds(sock, [b"S"], []))
    regions = wire._regions
    monkeypatch.setattr(wire, "_regions", lambda specs, seg: placed.append([s[-1] for s in specs]) or regions(specs, seg))
    w = Judging("cpu", isolate=True, timeout=20.0)
    try:
        rows = judged(w, QUANTIZE, ["torch-fp32"], "torch-fp32")
    finally:
        w.close()
    assert rows and all(r.passed for r in rows) and rows[0].metrics.numel > 0
    offsets = [o for answer in placed for o in answer]
    assert offsets and all(o is None for o in offsets)  # every tensor came through the pipe


def test_a_worker_scribbling_its_segment_after_answering_is_judged_on_what_it_answered():
    impl = "tests.hostile.boundary:scribbles_the_segment_after_answering"
    w = Judging("cpu", isolate=True, timeout=20.0)
    try:
        rows = judged(w, QUANTIZE, [impl], impl)
        out = w.worker._active.reader.segment
        time.sleep(0.6)
        assert bytes(out.view[:64]) == b"\xff" * 64  # it did scribble, after the verdict's copy was taken
    finally:
        w.close()
    assert rows and all(r.passed and "thread(s) running" in r.reason for r in rows), [r.reason for r in rows]


def test_a_worker_cannot_resize_or_unlink_the_segments_and_the_next_case_runs(tmp_path):
    impl = "tests.hostile.boundary:resizes_the_segments"
    w = Judging("cpu", isolate=True, timeout=20.0, sandbox="off")  # the seals hold unconfined; confined, it could write no report
    try:
        rows = judged(w, QUANTIZE, [impl], impl, run_id=str(tmp_path / "tried"))
        after = judged(w, Case(QUANTIZE.op, QUANTIZE.params, 4), ["torch-fp32"], "torch-fp32")
    finally:
        w.close()
    tried = (tmp_path / "tried").read_text().splitlines()
    assert len(tried) == 6 and all(line.endswith("PermissionError") for line in tried), tried
    assert rows and all(r.passed for r in rows) and after and all(r.passed for r in after)


@pytest.mark.gpu
def test_on_cuda_the_worker_copies_handed_inputs_to_the_device_once():
    """The host segment's copy to the device, one per storage: a CUDA judge's inputs, two of them views
    of one device storage, arrive in the worker as views of one device storage. (Moving each
    argument to the device on its own, as this test first did, made two storages of the one: the
    H100 lane's failure at 5fb709e was the test's.)"""
    kwargs = _strided_inputs("cuda")
    seg, handed = segment.hand_over(kwargs, None)
    try:
        got = segment.inputs_of(handed.described, segment.Mapped(seg.describe(), os.dup(seg.fd)), "cuda")
        for name in ("q", "same", "idx"):
            assert got[name].is_cuda and torch.equal(got[name], kwargs[name])
            assert got[name].stride() == kwargs[name].stride()
        assert got["q"].untyped_storage().data_ptr() == got["same"].untyped_storage().data_ptr()
        assert segment.written(seg, handed, ()) == []  # the device copy is the worker's own: its snapshot tells
    finally:
        seg.close()


@pytest.mark.gpu
def test_a_cuda_worker_handed_its_inputs_judges_as_one_that_builds_them():
    from mla_verify.bench.bench import harness_case

    c = harness_case("cpu")  # B=2 H=16: small enough for any GPU lane
    found = {}
    for hand_over in (False, True):
        w = Judging("cuda", isolate=True, timeout=120.0, hand_over=hand_over)
        try:
            found[hand_over] = judged(w, c, ["torch-fp32"], "torch-fp32")
        finally:
            w.close()
    assert all(rows and all(r.passed for r in rows) for rows in found.values())
    assert [r.metrics.numel for r in found[True]] == [r.metrics.numel for r in found[False]]


def test_outputs_too_large_for_the_segment_come_through_the_pipe_and_the_segment_grows(monkeypatch):
    from mla_verify.bench.bench import harness_case

    monkeypatch.setattr(segment, "INITIAL_BYTES", 4096)  # the decode case's outputs are 0.1 MiB
    placed = []
    regions = wire._regions
    monkeypatch.setattr(wire, "_regions", lambda specs, seg: placed.append([s[-1] for s in specs]) or regions(specs, seg))
    c = harness_case("cpu")
    w = Judging("cpu", isolate=True, timeout=60.0)
    try:
        first = judged(w, c, ["torch-fp32"], "torch-fp32")
        second = judged(w, Case(c.op, c.params, c.seed + 1), ["torch-fp32"], "torch-fp32")
    finally:
        w.close()
    assert first and second and all(r.passed for r in first + second)
    answers = [offsets for offsets in placed if offsets]  # the produced messages (out, lse)
    assert answers[0] == [None, None] and all(o is not None for o in answers[-1]), answers


def _verdicts(rows) -> list[tuple]:
    return sorted((r.tensor, r.passed, r.gate_metric, repr(r.value)) for r in rows)


def test_every_op_judged_isolated_on_handed_inputs_as_in_process(monkeypatch):
    """The worker called on the parent's inputs (views of the inputs segment: strided caches,
    a cache written in place) gives the verdicts an in-process evaluation gives, value for value;
    forward_mqa's Batch is not handed over (the worker builds it) and is judged the same too."""
    from mla_verify.equivalence.catalog import evaluate, resolve_subject

    corpus = json.loads((Path(__file__).resolve().parent.parent / "fuzz/corpus/forward_mqa.json").read_text())
    cases = [Case(op, params, 3) for op, params in CASES.items()] + [Case("forward_mqa", corpus[0]["params"], 30)]
    handed, hand_over = [], segment.hand_over

    def spy(kwargs, seg):
        kept, h = hand_over(kwargs, seg)
        handed.append(h)
        return kept, h

    monkeypatch.setattr(segment, "hand_over", spy)
    w = Judging("cpu", isolate=True, timeout=120.0)
    try:
        for case in cases:
            isolated = judged(w, case, [], "default")
            in_process = evaluate(case, resolve_subject(case.op, [], "cpu"), "cpu")
            assert isolated and _verdicts(isolated) == _verdicts(in_process), case.op
    finally:
        w.close()
    assert [h is not None for h in handed] == [True] * len(CASES) + [False]
    assert w.worker._not_plain == {"forward_mqa"}
