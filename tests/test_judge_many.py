"""A fuzz block judged at once (issue 28): `judge_many` gives each of C cases of one shape the
verdict `judge` gives it alone, with one set of ops (as many for 8 cases as for 1) and one read
back to the host for the block (two where some value is not finite)."""

import dataclasses
import math

import pytest
import torch

from mla_verify.bench.bench import OpCounter
from mla_verify.equivalence.judge.metrics import Metrics
from mla_verify.equivalence.judge.oracle import judge, judge_many
from mla_verify.equivalence.judge.policy import EXACT, LSE, OUT
from mla_verify.equivalence.cases.numerics import Numerics

SHAPES = {OUT: [(3, 4, 64), (5, 32), (0, 16)], LSE: [(3, 4), (7,), (0, 5)]}
CLOSE = {OUT: 2**-12, LSE: 2**-26}  # a relative error well within the bounds (LSE: ~1 fp32 step of its scale)
POLICIES = [(Numerics(), ()), (Numerics(scale_rule="raw"), ("bf16_cache_scale",))]


def _block(kind: str, shape: tuple, cases: int, seed: int, scaled: bool):
    """`cases` cases of one shape, as the k-th of a fuzz block: case 0 close, 1 of the wrong shape,
    2 NaN where the reference is finite and -inf where it is +inf, 3 far off, 4 close with the
    reference's +inf / -inf / NaN in place; each with its own scale and derived bounds."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(cases, *shape, generator=g, dtype=torch.float64) * 4
    noise = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    error = torch.tensor([CLOSE[kind], 0.0, CLOSE[kind], 1.0, CLOSE[kind]][:cases], dtype=torch.float64)
    impl = (ref * (1 + error.reshape(-1, *[1] * len(shape)) * noise)).to(torch.bfloat16 if kind == OUT else torch.float32)
    flat_ref, flat_impl = ref.view(cases, -1), impl.view(cases, -1)
    if flat_ref.shape[1] >= 3:
        for c in [c for c in (2, 4) if c < cases]:
            flat_ref[c, :3] = torch.tensor([math.inf, -math.inf, math.nan], dtype=torch.float64)
            flat_impl[c, :3] = flat_ref[c, :3].to(impl.dtype)
        if cases > 2:
            flat_impl[2, :2] = torch.tensor([-math.inf, math.nan])  # the reference's +inf, -inf
            flat_impl[2, 5 % flat_ref.shape[1]] = math.nan
    impls = list(impl)
    if cases > 1:
        impls[1] = impls[1][..., 1:]
    scale = bound = None
    if scaled:
        scale = (torch.rand(cases, *shape[:-1], generator=g, dtype=torch.float64) * 4 if kind == OUT
                 else torch.rand(cases, *shape, generator=g, dtype=torch.float64) * 50)
        derived = ref.abs().nan_to_num(nan=0.0, posinf=0.0) * 2**-7 + 2**-10
        bound = {"": derived, "bf16_cache_scale": 2 * derived}
    return impls, ref, scale, bound


def _close(x: float, y: float) -> bool:
    """Equal to a relative 1e-12: a case's reductions run over a [C, n] block, whose float64 sums
    may be ordered differently from one case's (last bits); NaN is NaN."""
    return (math.isnan(x) and math.isnan(y)) or x == y or abs(x - y) <= 1e-12 * max(abs(x), abs(y))


def _assert_same(alone, together) -> None:
    assert (together.passed, together.gate_metric, together.deviation, together.reason) == \
           (alone.passed, alone.gate_metric, alone.deviation, alone.reason)
    for value in ("value", "bound", "headroom"):
        assert _close(getattr(together, value), getattr(alone, value)), value
    for f in dataclasses.fields(Metrics):
        a, t = getattr(alone.metrics, f.name), getattr(together.metrics, f.name)
        if isinstance(a, float):
            assert _close(t, a), (f.name, t, a)
        else:  # counts, positions, shape and extra exactly
            assert t == a, (f.name, t, a)


@pytest.mark.parametrize("policy", POLICIES, ids=["default", "deviation"])
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "unscaled"])
@pytest.mark.parametrize("kind, shape", [(k, s) for k, shapes in SHAPES.items() for s in shapes])
@pytest.mark.parametrize("cases", [1, 2, 3, 4, 5])
def test_each_case_of_a_block_gets_the_verdict_it_gets_alone(kind, shape, cases, scaled, policy):
    numerics, deviations = policy
    impls, ref, scale, bound = _block(kind, shape, cases, seed=cases * 31 + len(shape), scaled=scaled)
    together = judge_many(kind, impls, ref, numerics, deviations, scale, bound, name=kind)
    assert len(together) == cases
    for i, v in enumerate(together):
        alone = judge(kind, impls[i], ref[i], numerics, deviations, None if scale is None else scale[i],
                      None if bound is None else {k: b[i] for k, b in bound.items()}, name=kind)
        _assert_same(alone, v)
    if cases == 5 and ref[0].numel():  # the block holds what it says it does
        assert [v.passed for v in together] == [True, False, False, False, True]
        assert together[1].gate_metric == "shape" and together[2].gate_metric == "inf_mismatch"
        assert together[2].metrics.inf_mismatch == 3 and together[2].metrics.nan_count == 2
        assert together[4].metrics.inf_mismatch == 0 and together[4].metrics.numel == ref[0].numel()


def test_exact_tensors_of_a_block_are_judged_each_as_alone():
    ref = torch.arange(24, dtype=torch.int32).reshape(3, 2, 4)
    impls = [ref[0].clone(), ref[1].clone(), ref[2][:, :3].clone()]
    impls[1][1, 2] = -1
    together = judge_many(EXACT, impls, ref, Numerics())
    assert [v.passed for v in together] == [True, False, False]
    for i, v in enumerate(together):
        _assert_same(judge(EXACT, impls[i], ref[i], Numerics()), v)


def _judged(kind: str, cases: int, nonfinite: bool) -> tuple[int, int]:
    """(aten ops, reads back to the host) of judging a passing block of `cases` cases. A CPU
    tensor's tolist() reads its memory without dispatching an op: those calls are counted too."""
    g = torch.Generator().manual_seed(cases)
    shape = (4, 16, 512) if kind == OUT else (4, 16)
    ref = torch.randn(cases, *shape, generator=g, dtype=torch.float64)
    if nonfinite:
        ref[:, 0, 0] = math.inf
    impls = [r.to(torch.bfloat16) if kind == OUT else r.float() for r in ref]
    scale = torch.rand(cases, *(shape[:-1] if kind == OUT else shape), generator=g, dtype=torch.float64)
    bound = {"": ref.abs().nan_to_num(posinf=0.0) * 2**-7 + 2**-10}
    counter, tolist, reads = OpCounter(), torch.Tensor.tolist, []

    def counted(t):
        reads.append(t.shape)
        return tolist(t)

    with pytest.MonkeyPatch.context() as patch, counter:
        patch.setattr(torch.Tensor, "tolist", counted)
        verdicts = judge_many(kind, impls, ref, Numerics(), (), scale, bound)
    assert all(v.passed for v in verdicts) and len(verdicts) == cases
    return counter.ops, counter.reads_back + len(reads)


@pytest.mark.parametrize("kind", [OUT, LSE])
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nonfinite"])
def test_a_block_is_one_set_of_ops_and_one_read_back_whatever_its_size(kind, nonfinite):
    ops, reads = _judged(kind, 1, nonfinite)
    assert _judged(kind, 8, nonfinite) == (ops, reads)
    assert reads == (2 if nonfinite else 1)  # the +inf/-inf/NaN classes: a second pass, once for the block
