"""The fused judge (equivalence.judge.fused) against the eager one, its reference: the same rows
and verdicts over the bug zoo, the hostile set and the gate's corpus, on the CPU with Triton
interpreted (and on a GPU compiled: `pytest -m gpu`). Each case is evaluated once and each of its
checks judged by both judges: the same verdict, gated metric, deviation, reason, counts and
positions, and every float metric, value, bound and headroom equal to float64 rounding (the fused
sums run in another order: a relative 1e-12, where they measure ~1e-15)."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from mla_verify.equivalence import catalog
from mla_verify.equivalence.judge import fused as fused_judge, metrics, oracle
from mla_verify.equivalence.ops import base
from mla_verify.equivalence.judge.policy import OUT
from mla_verify.equivalence.cases.numerics import Numerics
from mla_verify.equivalence.cases.profiles import get_profile
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


def _same(want: list, got: list) -> None:
    """Two judges' verdicts of one check of a block: equal, floats to float64 rounding."""
    assert len(want) == len(got)
    for e, f in zip(want, got):
        assert (e.passed, e.gate_metric, e.deviation, e.reason) == (f.passed, f.gate_metric, f.deviation, f.reason)
        for name, value in [*vars(e.metrics).items(), ("value", e.value), ("bound", e.bound), ("headroom", e.headroom)]:
            other = getattr(f.metrics, name) if name in vars(e.metrics) else getattr(f, name)
            if isinstance(value, float) and math.isfinite(value):
                assert other == pytest.approx(value, rel=CLOSE, abs=1e-300), name
            else:
                assert other == value or (other != other and value != value), (name, other, value)


def _both(monkeypatch, cases, impl, device) -> int:
    """Evaluate `cases` once, each check judged by both judges (the fused one's verdicts kept):
    how many outputs were compared."""
    subject = catalog.resolve_subject(cases[0].op, [impl] if impl else [], device)
    outputs = []

    def both(kind, *args, **kwargs):
        monkeypatch.setenv(oracle.JUDGE_ENV, "eager")
        want = oracle.judge_many(kind, *args, **kwargs)
        monkeypatch.setenv(oracle.JUDGE_ENV, "fused")
        got = oracle.judge_many(kind, *args, **kwargs)
        _same(want, got)
        outputs.extend([kind] * len(got) if kind == OUT else [])
        return got

    monkeypatch.setattr(base, "judge_many", both)
    for case in cases:
        catalog.evaluate(case, subject, device, source="fuzz")
    return len(outputs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_gate_corpus_rows_are_the_eager_judges(monkeypatch, op, device):
    assert _both(monkeypatch, [case for case, _ in corpus(op)], None, device)  # outputs were measured


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


@pytest.mark.parametrize("tile", [512, 8192])  # one row a program (the GPU's launch), many (the interpreter's)
def test_the_fused_scalars_are_the_eager_ones_whatever_the_launch(monkeypatch, tile):
    torch.manual_seed(tile)
    r = torch.randn(3, 5, 7, 512, dtype=torch.float64) * torch.rand(3, 5, 7, 1, dtype=torch.float64).pow(4)
    a = (r + 1e-3 * torch.randn_like(r) * r.abs()).to(torch.bfloat16)
    a.view(-1)[5], r.view(-1)[9], a.view(-1)[9] = math.nan, math.inf, math.inf
    value_max, bound = torch.rand(3, 5, 7) * 3, r.abs() * 0.01 + 1e-3
    monkeypatch.setattr(fused_judge, "TILE", tile)
    for args in [(None, None), (value_max, bound)]:
        for want, got in zip(metrics.outputs(a, r, 4.0, *args), metrics.outputs(a, r, 4.0, *args, fused=True)):
            for name, value in vars(want).items():
                other = getattr(got, name)
                if isinstance(value, float) and math.isfinite(value):
                    assert other == pytest.approx(value, rel=CLOSE, abs=1e-300), name
                else:
                    assert other == value or (other != other and value != value), name


def test_an_unknown_judge_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="unknown judge"):
        oracle.use_judge("quick")
    monkeypatch.setenv(oracle.JUDGE_ENV, "quick")
    with pytest.raises(ValueError, match="quick"):
        oracle.fused_on(torch.device("cpu"))
