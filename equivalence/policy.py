"""The tolerance policy: every bound the oracle holds an implementation to, with its reason.

A bound is a metric of `equivalence.metrics` and the largest value a correct implementation may
show. Three rules hold for every float tensor and are not tolerances: +inf/-inf/NaN must sit where
the reference has them (`inf_mismatch` = 0) and an implementation never adds NaN (`nan_count` = 0).
Exact contracts (bytes, indices, chunk bounds, reshapes) allow no difference at all.

Calibration (the numbers in each reason): worst values seen over the `dev` fuzz profile of every
op on CPU (torch-fp32 and the Triton kernels under the interpreter) and the `gpu` profile on the
H200 (flash_mla and compiled Triton), see README "Tolerances". Each bound keeps a few times
headroom over the worst correct value and stays far below what the bug zoo produces.

An implementation's documented deviation from the exact contract (e.g. the SM90 decode kernel
rounding fp32 cache scales to bf16) is listed on its registry entry; where it applies, its own
wider bounds replace the default ones, and the row names the deviation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping


@dataclass(frozen=True)
class Bound:
    metric: str
    limit: float
    reason: str


# Tensor kinds: how each compared tensor is measured (equivalence.metrics) and bounded here.
EXACT, OUT, LSE = "exact", "out", "lse"

EXACT_BOUNDS = (Bound("mismatch_frac", 0.0, "the contract fixes every bit"),)

OUT_BOUNDS = (
    Bound("bf16_units", 6.0,
          "a bf16 output with fp32 accumulation and bf16 softmax weights sits 1-3 units from the "
          "exact answer (flash_mla measured rel L2 2.1e-3, about 2 units)"),
    Bound("elem_bf16_units", 12.0,
          "the worst element: rounding alone is <= 1 step of its row's magnitude; bf16 softmax "
          "weights add a few"),
    Bound("abs_mean_err", 1e-3,
          "rounding to nearest is unbiased: a correct kernel's mean relative error is noise, "
          "~2**-8 / sqrt(3 numel) <= 1e-4 at 512 elements; a wrong scale or a dropped key biases it"),
)

LSE_BOUNDS = (
    Bound("lse_fp32_units", 64.0,
          "a 576-term fp32 dot product errs by ~sqrt(576) = 24 fp32 steps of its logit scale: "
          "worst seen 18.8 (flash_mla and Triton, outlier channels, H200); one dropped key of "
          "2048 moves a broad softmax's LSE by ~5e-4, over 100 units of a normal-regime row"),
)

# Deviations an implementation may declare (optimized.registry), when they apply, and the bounds
# that replace the defaults for the tensor kinds they touch.
Applies = Callable[[Mapping], bool]


@dataclass(frozen=True)
class Deviation:
    name: str
    description: str
    applies: Applies
    bounds: Mapping[str, tuple[Bound, ...]]


def _raw_scales(params: Mapping) -> bool:
    return params.get("scale_rule", "pow2") == "raw" and params.get("cache_dtype", "fp8_ds_mla") == "fp8_ds_mla"


DEVIATIONS = {
    d.name: d
    for d in (
        Deviation(
            "bf16_dequant",
            "dequantizes fp8_ds_mla rows to bf16 before the tensor-core dot: exact with power-of-two "
            "scales, a rounding of each key element (<= 2**-8 relative) with raw amax/448 scales",
            _raw_scales,
            {
                OUT: (Bound("bf16_units", 64.0, "each logit moves by <= 2**-8 of its logit scale"),
                      Bound("elem_bf16_units", 256.0, "as bf16_units, per element"),
                      Bound("abs_mean_err", 4e-3, "key rounding is unbiased; the softmax reweighting is not quite")),
                LSE: (Bound("lse_fp32_units", 2.0**16 + 32, "|dLSE| <= max_j |ds_j| <= 2**-8 * logit scale = 2**16 fp32 units"),),
            },
        ),
        Deviation(
            "bf16_cache_scale",
            "the SM90 FlashMLA decode kernel rounds each fp32 tile scale to bf16 before use "
            "(measured on the H200 against the exact dequantization: out rel 8.1e-3, lse max abs 4.4e-2)",
            _raw_scales,
            {
                OUT: (Bound("bf16_units", 96.0, "biased by up to 2**-8 per tile, plus the bf16 product rounding"),
                      Bound("elem_bf16_units", 384.0, "as bf16_units, per element"),
                      Bound("abs_mean_err", 2e-2, "a scale rounded the same way for a whole tile biases the tile")),
                LSE: (Bound("lse_fp32_units", 2.0**17 + 32, "scale and product roundings: |ds_j| <= 2**-7 * logit scale"),),
            },
        ),
    )
}


def dcp_roundings(dcp_size: int, combine: str = "merge") -> int:
    """bf16 roundings in a merged DCP output of N ranks: every rank's partial (N), plus what the
    combine adds. In-process merge: each scaled term (N) and the fp32 sum (1); all-gather +
    reduce-scatter: each scaled term (N) and the collective's N - 1 bf16 additions; all-to-all:
    one rounding of the fp32 sum."""
    extra = {"merge": dcp_size + 1, "ag_rs": 2 * dcp_size - 1, "a2a": 1}
    if combine not in extra:
        raise ValueError(f"unknown DCP combine {combine!r}; known: {', '.join(extra)}")
    return dcp_size + extra[combine]


def dcp_out_bounds(dcp_size: int, combine: str = "merge") -> tuple[Bound, ...]:
    """The merged DCP output: `dcp_roundings` bf16 roundings instead of one."""
    factor = dcp_roundings(dcp_size, combine)
    return (
        Bound("bf16_units", 6.0 * factor**0.5,
              f"{factor} bf16 roundings of terms of about the output's size add in quadrature"),
        Bound("elem_bf16_units", 12.0 * factor, f"{factor} roundings of up to one step each"),
        Bound("abs_mean_err", 1e-3, "rounding to nearest stays unbiased across ranks"),
    )


def bounds_for(kind: str, params: Mapping, deviations: Iterable[str] = ()) -> tuple[tuple[Bound, ...], str]:
    """The bounds for one compared tensor, and the name(s) of the deviations that set them."""
    if kind == EXACT:
        return EXACT_BOUNDS, ""
    # DEVIATIONS is ordered narrowest first: the widest one that applies sets the bounds.
    for dev in reversed(DEVIATIONS.values()):
        if dev.name in deviations and dev.applies(params) and kind in dev.bounds:
            return dev.bounds[kind], dev.name
    if kind == OUT:
        dcp = params.get("dcp_size", 1)
        return (dcp_out_bounds(dcp, params.get("combine", "merge")) if dcp > 1 else OUT_BOUNDS), ""
    if kind == LSE:
        return LSE_BOUNDS, ""
    raise ValueError(f"unknown tensor kind {kind!r}")


def all_bounds() -> list[tuple[str, str, Bound]]:
    """Every bound with where it applies, for `mla-verify list --tolerances` and the README."""
    rows = [(EXACT, "", b) for b in EXACT_BOUNDS]
    rows += [(OUT, "", b) for b in OUT_BOUNDS] + [(LSE, "", b) for b in LSE_BOUNDS]
    rows += [(OUT, f"dcp {combine} (2 ranks)", b) for combine in ("merge", "ag_rs", "a2a") for b in dcp_out_bounds(2, combine)]
    for dev in DEVIATIONS.values():
        rows += [(kind, dev.name, b) for kind, bs in dev.bounds.items() for b in bs]
    return rows
