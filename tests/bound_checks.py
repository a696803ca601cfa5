"""Assertions of the derived error bounds (the math: mla_verify.equivalence.judge.bounds) and the
test-only helpers around them: which torch-fp32 stages to run, how a failure reads."""

from __future__ import annotations

import math

import torch
from hypothesis import currently_in_test_context, note

from mla_verify.equivalence.judge import bounds as EB
from mla_verify.optimized import registry
from mla_verify.optimized.kernels import interpreting


def fp32_stages(needed, device="cpu"):
    """The torch-fp32 implementation of every stage that has one, the only one elsewhere."""
    overrides = {
        stage: registry.select(stage, device, "torch-fp32")
        for stage in needed
        if any(impl.name == "torch-fp32" for impl in registry.implementations(stage))
    }
    return registry.resolve(needed, device, overrides)


def check_against_reference(out, lse, ref_out, ref_lse, model: EB.ErrorModel):
    """NaN never; +-inf patterns exact; empty rows exactly 0; finite LSE, every element and the
    aggregate within the fp32 model (bounds section 2)."""
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert not bool(out.isnan().any()) and not bool(lse.isnan().any())
    for sign in (1, -1):
        assert torch.equal(lse == sign * math.inf, ref_lse == sign * math.inf)
    live = ref_lse.isfinite()
    assert bool((out[~live] == 0).all())
    lse_err = (lse.double() - ref_lse)[live].abs()
    assert bool((lse_err <= model.lse(ref_lse)[live]).all()), f"LSE error {lse_err.max():.3g}"
    o, r = out.double(), ref_out
    excess = (o - r).abs() - EB.bf16_rounding(r)
    assert bool((excess <= model.out_excess()).all()), f"out excess {excess.max():.3g}"
    assert torch.linalg.norm(o - r) <= (1 + EB.FP32_AGGREGATE) * torch.linalg.norm(EB.bf16_rounding(r))


def kernel_unit() -> float:
    """u for the kernels under test: IEEE round to nearest under the interpreter, else a GPU's."""
    return EB.fp32_unit(truncating=not interpreting())


def check_attention(label, got, ref, ab, topk, dequant_rel=0.0):
    """Compare got = (out, lse, max_logits | None) with ref = (out, lse, max_logits | None,
    logit_l1[, magnitudes]), all laid out [n, H(, 512)], against `bounds.attention_bounds` (IEEE
    subnormal floors); ab = the reference's magnitudes (out_abs, value_abs)."""
    out, lse, max_logits = got
    ref_out, ref_lse, ref_max, l1 = ref[:4]
    assert not bool(torch.isnan(out).any()), f"{label}: NaN in out"
    assert not bool(torch.isnan(lse).any()), f"{label}: NaN in lse"
    lse, ref_lse = lse.double(), ref_lse.double()
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), live), f"{label}: finite-lse pattern differs from the reference"
    assert torch.equal(lse[~live], ref_lse[~live]), f"{label}: lse of empty rows must be +inf"
    assert bool((out[~live] == 0).all()), f"{label}: out of empty rows must be exactly 0"

    exact = EB.Exact(ref_out, ref_lse, ref_max if ref_max is not None else ref_lse, l1, *ab)
    bounds = EB.attention_bounds(exact, topk, unit=kernel_unit(), dequant_rel=dequant_rel, ftz=False)
    lse_err = torch.where(live, (lse - ref_lse).abs(), 0)
    worst = int(torch.argmax(lse_err - bounds.lse))
    assert bool((lse_err <= bounds.lse).all()), (
        f"{label}: lse error {lse_err.flatten()[worst]:.3e} > bound {bounds.lse.flatten()[worst]:.3e} at flat {worst}"
    )
    if max_logits is not None:
        max_logits, ref_max = max_logits.double(), ref_max.double()
        assert torch.equal(max_logits[~live], ref_max[~live]), f"{label}: max_logits of empty rows must be -inf"
        max_err = torch.where(live, (max_logits - ref_max).abs(), 0)
        assert bool((max_err <= bounds.max_logits).all()), (
            f"{label}: max_logits error {float(max_err.max()):.3e} over the score bound"
        )

    err = (out.double() - ref_out).abs()
    rounding = (ref_out.bfloat16().double() - ref_out).norm()
    units = float(err.norm() / rounding) if rounding > 0 else float("nan")
    summary = f"{label}: ||out - ref|| = {units:.3f} bf16 roundings of the reference"
    if currently_in_test_context():
        note(summary)
    else:
        print(summary)
    worst = int(torch.argmax(err - bounds.out))
    assert bool((err <= bounds.out).all()), (
        f"{label}: out error {err.flatten()[worst]:.3e} > bound {bounds.out.flatten()[worst]:.3e} at flat index "
        f"{worst} (ref {ref_out.flatten()[worst]:.4e}); overall {units:.2f} bf16 roundings of the reference"
    )
