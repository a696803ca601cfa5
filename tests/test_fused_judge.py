"""The fused judge (equivalence.fused_judge) against the eager one, its reference: the same rows
and verdicts over the bug zoo, the hostile set and the gate's corpus, on the CPU with Triton
interpreted (and on a GPU compiled: `pytest -m gpu`). Same means: every verdict, gated metric,
deviation, reason, count and position equal; every float metric equal to float64 rounding (the
fused sums run in another order: a relative 1e-12, where they measure ~1e-15)."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from mla_verify.equivalence import catalog, metrics, oracle
from mla_verify.equivalence.policy import OUT, Numerics
from mla_verify.equivalence.profiles import get_profile
from mla_verify.fuzz.regressions import corpus
from tests.hostile import CPU as HOSTILE
from tests.zoo import ZOO

OPS = ("sparse_prefill", "sparse_decode_fp8", "forward_mqa")  # the ops with attention outputs
CLOSE = 1e-12
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _drawn(op: str, path: str | None, count: int, seed: int) -> list:
    found = []

    @settings(max_examples=count, database=None, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(catalog.get_spec(op).strategy(get_profile("ci"), path))
    def draw(case):
        found.append(case.__class__(case.op, case.params, case.seed + seed))

    draw()
    return found


def _same_rows(eager: list, fused: list) -> None:
    assert len(eager) == len(fused)
    for e, f in zip(eager, fused):
        assert (e.tensor, e.passed, e.gate_metric, e.deviation, e.reason) == (f.tensor, f.passed, f.gate_metric, f.deviation, f.reason)
        for name, want in [*vars(e.metrics).items(), ("value", e.value), ("bound", e.bound), ("headroom", e.headroom)]:
            got = getattr(f.metrics, name) if name in vars(e.metrics) else getattr(f, name)
            if isinstance(want, float) and not (math.isnan(want) or math.isinf(want)):
                assert got == pytest.approx(want, rel=CLOSE, abs=1e-300), (e.tensor, name)
            else:
                assert got == want or (got != got and want != want), (e.tensor, name, got, want)


def _both(monkeypatch, cases, impl, device):
    subject = catalog.resolve_subject(cases[0].op, [impl] if impl else [], device)
    rows = {}
    for judge in ("eager", "fused"):
        monkeypatch.setenv(oracle.JUDGE_ENV, judge)
        rows[judge] = [catalog.evaluate(c, subject, device, source="fuzz") for c in cases]
    for eager, fused in zip(rows["eager"], rows["fused"]):
        _same_rows(eager, fused)
    return rows["eager"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_gate_corpus_rows_are_the_eager_judges(monkeypatch, op, device):
    rows = _both(monkeypatch, [case for case, _ in corpus(op)], None, device)
    assert any(r.kind == "out" for case in rows for r in case)  # the fused judge had outputs to measure


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bug", [b for b in ZOO if b.op in OPS], ids=lambda b: b.name)
def test_zoo_rows_are_the_eager_judges(monkeypatch, bug, device):
    _both(monkeypatch, _drawn(bug.op, bug.path, 2, 11), bug.impl, device)


@pytest.mark.parametrize("hostile", [h for h in HOSTILE if h.op in OPS and not h.isolate], ids=lambda h: h.impl)
def test_hostile_rows_are_the_eager_judges(monkeypatch, hostile):
    _both(monkeypatch, _drawn(hostile.op, None, 2, 5), hostile.impl, "cpu")


def test_a_failure_is_measured_and_described_by_the_eager_judge(monkeypatch):
    r = torch.randn(2, 4, 64, dtype=torch.float64)
    a = r.clone().to(torch.bfloat16)
    a[1, 2, 7] += 1.0
    case = Numerics()
    monkeypatch.setenv(oracle.JUDGE_ENV, "fused")
    calls = []
    eager = metrics.outputs
    monkeypatch.setattr(metrics, "outputs", lambda *args, fused=False: calls.append(fused) or eager(*args, fused=fused))
    fused = oracle.judge_many(OUT, list(a), r, case, name="out")
    assert calls == [True, False]  # the block fused, then the failing case alone, eager
    monkeypatch.setenv(oracle.JUDGE_ENV, "eager")
    want = oracle.judge_many(OUT, list(a), r, case, name="out")
    assert [v.passed for v in fused] == [True, False] == [v.passed for v in want]
    assert fused[1].reason == want[1].reason and vars(fused[1].metrics) == vars(want[1].metrics)


def test_an_unknown_judge_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="unknown judge"):
        oracle.use_judge("quick")
    monkeypatch.setenv(oracle.JUDGE_ENV, "quick")
    with pytest.raises(ValueError, match="quick"):
        oracle.fused_on(torch.device("cpu"))
