"""The tolerance policy: every bound the oracle holds an implementation to, with its reason.

A bound is a metric of `equivalence.judge.metrics` and the largest value a correct implementation may
show. Three rules hold for every float tensor and are not tolerances: +inf/-inf/NaN must sit where
the reference has them (`inf_mismatch` = 0) and an implementation never adds NaN (`nan_count` = 0).
Exact contracts (bytes, indices, chunk bounds, reshapes) allow no difference at all.

Calibration (the numbers in each reason): worst values seen over the `dev` fuzz profile of every
op on CPU (torch-fp32 and the Triton kernels under the interpreter) and the `gpu` profile on the
H200 (flash_mla and compiled Triton), see docs/concepts/bounds.md. Each bound keeps a few times
headroom over the worst correct value and stays far below what the bug zoo produces.

An implementation's documented deviation from the exact contract (e.g. the SM90 decode kernel
rounding fp32 cache scales to bf16) is listed on its registry entry; where it applies, its own
wider bounds replace the default ones, and the row names the deviation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable, Iterable, Mapping

from ..cases.numerics import Numerics


@dataclass(frozen=True)
class Bound:
    metric: str
    limit: float
    reason: str


class Kind(StrEnum):
    """How a compared tensor is measured (`oracle.COMPARISONS`, one comparison a kind) and which
    bounds here hold it; stored in rows as its value."""

    EXACT = "exact"  # bit for bit: cache bytes, indices, what a property keeps bitwise
    OUT = "out"      # an attention output, in bf16 rounding units of its rows
    LSE = "lse"      # a log-sum-exp (max_logits too), in fp32 steps of its row's logit scale


EXACT, OUT, LSE = Kind.EXACT, Kind.OUT, Kind.LSE

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
    Bound("elem_bound_ratio", 1.0,
          "every element within the bound derived from a correct kernel's arithmetic (equivalence.judge.bounds: bf16 "
          "P, fp32 accumulation with u = 2**-23, the bf16 output rounding, flush-to-zero floors); only where the "
          "op's reference derives it (sparse_prefill, sparse_decode_fp8)"),
)

LSE_BOUNDS = (
    Bound("lse_fp32_units", 64.0,
          "a 576-term fp32 dot product errs by ~sqrt(576) = 24 fp32 steps of its logit scale: "
          "worst seen 18.8 (flash_mla and Triton, outlier channels, H200); one dropped key of "
          "2048 moves a broad softmax's LSE by ~5e-4, over 100 units of a normal-regime row"),
    Bound("elem_bound_ratio", 1.0,
          "every LSE (and max_logit) within the derived score bound (equivalence.judge.bounds: gamma_600 of the logit "
          "scale, the sum of K exponentials, exp2/log); only where the op's reference derives it"),
)

# A deviation whose kernel multiplies rows rounded to bf16 (non-power-of-two scales) keeps the
# derived per-element bound, with that rounding in it: the reference derives a bound per such
# deviation (`equivalence.judge.bounds.DEQUANT_REL`, its relative error of each row element).
_DEQUANT_BOUND = "the derived bound (equivalence.judge.bounds) with each K and V element off by dequant_rel = "
_CACHE_SCALE_REL = ("2**-8 + 2**-9 + 2**-17 (the fp32 tile scale rounded to bf16, 2**-9, then the product to bf16, "
                    "2**-8 as bf16_dequant's; derived, not measured)")

# Deviations an implementation may declare (optimized.registry; a user's kernel through
# equivalence.subject), when they apply, and the bounds that replace the defaults for the tensor
# kinds they touch. `applies.__doc__` says when, for `mla-verify list --deviations`.
Applies = Callable[[Numerics], bool]


@dataclass(frozen=True)
class Deviation:
    name: str
    description: str
    applies: Applies                          # to comparisons with the reference
    bounds: Mapping[str, tuple[Bound, ...]]   # kind -> bounds there
    # Property checks (PROPERTY_RULES) whose bitwise promise it breaks, and their bounds (per kind).
    relaxes: frozenset[str] = frozenset()
    property_bounds: Mapping[str, tuple[Bound, ...]] = field(default_factory=dict)


def _raw_scales(case: Numerics) -> bool:
    """comparisons with the reference on fp8_ds_mla caches with raw (amax/448) scales"""
    return case.scale_rule == "raw" and case.cache_dtype == "fp8_ds_mla"


def _never(case: Numerics) -> bool:
    """no comparison with the reference; only the property checks it relaxes"""
    return False


DEVIATIONS = {
    d.name: d
    for d in (
        Deviation(
            "bf16_dequant",
            "dequantizes fp8_ds_mla rows to bf16 before the tensor-core dot: exact with power-of-two "
            "scales, a rounding of each key element (<= 2**-8 relative) with raw amax/448 scales",
            _raw_scales,
            # No abs_mean_err: the rounded logits reweight a row's softmax coherently, so a correct
            # kernel's row is off by more than rounding noise (tests.impls.bf16_dequant, peaked values,
            # 1 head, raw scales: 0.038, four times the 2**-9-a-row floor of `limit_for`; the 4e-3 it had
            # failed 3 of 480 such CPU cases). Its elements are held to the derived bound, which carries
            # that reweighting, and a bias across cases is the bias report's (`reports.bias`).
            {
                OUT: (Bound("bf16_units", 64.0, "each logit moves by <= 2**-8 of its logit scale"),
                      Bound("elem_bf16_units", 256.0, "as bf16_units, per element"),
                      Bound("elem_bound_ratio", 1.0, _DEQUANT_BOUND + "2**-8 (one bf16 rounding)")),
                LSE: (Bound("lse_fp32_units", 2.0**16 + 32, "|dLSE| <= max_j |ds_j| <= 2**-8 * logit scale = 2**16 fp32 units"),
                      Bound("elem_bound_ratio", 1.0, _DEQUANT_BOUND + "2**-8 (one bf16 rounding)")),
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
                      Bound("abs_mean_err", 2e-2, "a scale rounded the same way for a whole tile biases the tile"),
                      Bound("elem_bound_ratio", 1.0, _DEQUANT_BOUND + _CACHE_SCALE_REL)),
                LSE: (Bound("lse_fp32_units", 2.0**17 + 32, "scale and product roundings: |ds_j| <= 2**-7 * logit scale"),
                      Bound("elem_bound_ratio", 1.0, _DEQUANT_BOUND + _CACHE_SCALE_REL)),
            },
        ),
        Deviation(
            "loop_bound",
            "our Triton prefill ends its loop over top-k blocks at topk_length instead of masking "
            "the tail, so its compiled fp32 sums differ in the last bits from the call with -1 "
            "padding (measured on the H200: 1 bf16 ulp on 5e-5 of the outputs, LSE 7.6e-6 apart; "
            "bitwise under the CPU interpreter)",
            _never,
            {},
            relaxes=frozenset({"padding_and_order.topk_length"}),
            property_bounds={
                OUT: (Bound("elem_bf16_units", 4.0, "one bf16 ulp of an element is at most 2 steps of its row's scale"),
                      Bound("bf16_units", 8.0, "one ulp on every element at most"),
                      Bound("abs_mean_err", 1e-3, "a reordered fp32 sum differs without bias")),
                LSE: (Bound("lse_fp32_units", 32.0, "a few fp32 steps of the logit scale (measured 7.6e-6 on an LSE of 10.6)"),),
            },
        ),
        Deviation(
            "gemm_batch",
            "eager PyTorch attention: cuBLAS picks its GEMM kernels by the batch count, so a "
            "request's fp32 logits depend on the batch around it (measured on the H200: "
            "torch-fp32 batched and chunked results differ in the last bits; bitwise on CPU)",
            _never,
            {},
            relaxes=frozenset({"batch_invariance.batched", "batch_invariance.chunked", "spec_decode.single_tokens",
                               "hisparse_equals_plain.layers"}),
            property_bounds={
                OUT: (Bound("elem_bf16_units", 4.0, "a few fp32 roundings shift the bf16 output by at most one ulp"),
                      Bound("bf16_units", 8.0, "one ulp on every element at most"),
                      Bound("abs_mean_err", 1e-3, "reordered fp32 sums differ without bias")),
                LSE: (Bound("lse_fp32_units", 32.0, "a reordered 576-term fp32 dot moves a logit by a few steps"),),
            },
        ),
        Deviation(
            "split_kv",
            "splits a short decode batch's top-k lists over several programs and merges the fp32 "
            "partials, so a request's result depends on the batch around it (FlashMLA on the H200: "
            "a request alone vs in a batch of 8 or 128 differs by up to 1 bf16 ulp); exact against "
            "the reference's bounds, never bitwise batch invariant",
            _never,
            {},
            relaxes=frozenset({"batch_invariance.batched", "spec_decode.single_tokens", "v4_extra_empty.no_extra",
                               "v4_row_alone.alone", "cuda_graph.unpadded"}),
            property_bounds={
                OUT: (Bound("elem_bf16_units", 4.0,
                            "one bf16 ulp of an element is at most 2 steps of 2**-8 * its row's largest"),
                      Bound("bf16_units", 8.0,
                            "one ulp on every element at most: ||d|| <= 2**-7 ||out|| = 8 units of 2**-10 ||out||"),
                      Bound("abs_mean_err", 1e-3, "the two roundings of one fp32 value differ without bias")),
                LSE: (Bound("lse_fp32_units", 32.0, "the split merge's exp2/log2 move the fp32 LSE by a few steps"),),
            },
        ),
        Deviation(
            "length_plan",
            "FlashMLA plans its split-KV work from the values of topk_length and extra_topk_length (a "
            "plan bakes them in), so an extra list of -1 entries and one of length 0 are scheduled over "
            "different splits and their fp32 partials merge in another grouping",
            _never,
            {},
            relaxes=frozenset({"v4_extra_empty.all_invalid"}),
            property_bounds={
                OUT: (Bound("elem_bf16_units", 4.0,
                            "one bf16 ulp of an element is at most 2 steps of 2**-8 * its row's largest"),
                      Bound("bf16_units", 8.0, "one ulp on every element at most"),
                      Bound("abs_mean_err", 1e-3, "the two roundings of one fp32 value differ without bias")),
                LSE: (Bound("lse_fp32_units", 32.0, "the split merge's exp2/log2 move the fp32 LSE by a few steps"),),
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


def limit_for(bound: Bound, rows: int) -> float:
    """The bound's limit for one tensor: a bias estimated from few rows carries their rounding
    noise, so `abs_mean_err` never drops below 5 standard deviations of the mean of `rows` rows'
    gain errors, each within 2**-9 (bf16 softmax weights shift a row's gain by up to half a bf16
    step; measured: Triton decode, 2 rows, 5.7e-4)."""
    if bound.metric == "abs_mean_err" and rows > 0:
        return max(bound.limit, 5 * 2.0**-9 / rows**0.5)
    return bound.limit


def bounds_for(kind: str, case: Numerics = Numerics(), deviations: Iterable[str] = ()) -> tuple[tuple[Bound, ...], str]:
    """The bounds for one compared tensor, and the name(s) of the deviations that set them."""
    if kind == EXACT:
        return EXACT_BOUNDS, ""
    # DEVIATIONS is ordered narrowest first: the widest one that applies sets the bounds.
    for dev in reversed(DEVIATIONS.values()):
        if dev.name in deviations and dev.applies(case) and kind in dev.bounds:
            return dev.bounds[kind], dev.name
    if kind == OUT:
        return (dcp_out_bounds(case.dcp_size, case.combine) if case.dcp_size > 1 else OUT_BOUNDS), ""
    if kind == LSE:
        return LSE_BOUNDS, ""
    raise ValueError(f"unknown tensor kind {kind!r}")


# ----------------------------------------------------------------------------- properties
#
# A property (equivalence.properties) holds an implementation to itself: one problem posed two
# ways that agree in exact arithmetic. Where the kernels promise identical bits (the same
# arithmetic on the same values, only arranged differently) the check is exact, and a kernel that
# cannot keep the promise says so with a deviation that `relaxes` it. Elsewhere the two sides
# differ by reassociation and their own roundings. `out` is then measured against the other
# side's bf16 output: bf16(ref) - ref = 0 there, so the bf16_units unit is its floor 2**-10 ||out||
# (metrics.output), about half the norm of one bf16 rounding; elem_bf16_units keeps its meaning.
# LSE units use the Cauchy-Schwarz logit scale sm_scale * ||q|| * max_j ||K_j|| (1-1.6x the
# oracle's logit_l1; properties never form the [T, H, K] product). The worst values in the
# reasons are CPU measurements (ci and dev profiles, torch-fp32 and the Triton interpreter, 40-130
# cases a check); scripts/gpu_properties.py measures FlashMLA and compiled Triton on the H200.


@dataclass(frozen=True)
class PropertyRule:
    """How one check of a property compares the implementation with itself."""

    bitwise: bool
    reason: str
    bounds: Mapping[str, tuple[Bound, ...]] = field(default_factory=dict)  # kind -> bounds, when not bitwise


def _rounding_apart(measured: str, two_kernels: bool = False) -> dict[str, tuple[Bound, ...]]:
    """Bounds of two bf16 answers a few roundings apart; `measured` says what was seen.

    One kernel reordering its work computes every logit bit for bit the same (a key's dot product
    does not depend on where the key sits), so its LSEs differ only by the order of the fp32 sum
    of exponentials; `two_kernels` compute their logits independently, each within the oracle's
    LSE bound of the exact one."""
    lse = (Bound("lse_fp32_units", 2 * LSE_BOUNDS[0].limit,
                 f"two kernels' logits, each within {LSE_BOUNDS[0].limit:g} units of the exact ones ({measured})")
           if two_kernels else
           Bound("lse_fp32_units", 32.0,
                 f"the same logits, their exponentials summed in another grouping ({measured}); a dropped key of "
                 "2048 moves a broad softmax's LSE by ~100"))
    return {
        OUT: (Bound("bf16_units", 12.0,
                    f"two bf16 answers each ~2 oracle units (~3.4 of these) from the exact one, a few apart ({measured}); "
                    "a 1% gain error is 10"),
              Bound("elem_bf16_units", 8.0, f"a few roundings of the element, each <= 1 step ({measured})"),
              Bound("abs_mean_err", 4e-3,
                    "unbiased, but P is rounded to bf16 once per key and head and that error is shared by the 512 "
                    "outputs of the row, so a one-head problem's mean moves (CPU worst 7e-4); a 0.4% gain error shows")),
        LSE: (lse,),
    }


PROPERTY_RULES: dict[str, PropertyRule] = {
    "split_invariance.merged": PropertyRule(
        False, "the float64 merge of the parts' bf16 outputs against one bf16 output of the whole",
        _rounding_apart("CPU worst: out 3.2 units, element 1.8, lse 0.44")),
    "decode_equals_prefill.prefill": PropertyRule(
        False, "two kernels over the same bf16 rows (power-of-two scales dequantize exactly)",
        _rounding_apart("CPU worst: Triton out 1.5 units, element 1.8, lse 0.27; torch-fp32 bitwise", two_kernels=True)),
    "padding_and_order.wider_k": PropertyRule(
        False, "extra invalid entries regroup the valid ones into other blocks (decode: another split plan)",
        _rounding_apart("CPU worst: out 1.9 units, element 1.9, lse 0.24")),
    "padding_and_order.permuted": PropertyRule(
        False, "the online softmax visits the same keys in another order",
        _rounding_apart("CPU worst: out 2.3 units, element 1.9, lse 0.32")),
    "padding_and_order.padded_heads": PropertyRule(
        False, "another head tile (FlashMLA: another kernel past 64 heads; torch: another GEMM blocking)",
        _rounding_apart("CPU worst: out 0.03 units, element 1.0, lse 0.5", two_kernels=True)),
    "padding_and_order.padded_tokens": PropertyRule(
        False, "more rows in the launch (decode: another split plan)",
        _rounding_apart("CPU: bitwise for torch-fp32 and Triton")),
    "padding_and_order.topk_length": PropertyRule(
        True, "FlashMLA's tests check topk_length against -1 tail padding bit for bit; the Triton prefill "
        "ends its loop at topk_length and all-invalid blocks leave its running sums unchanged; torch-fp32 "
        "builds the same mask either way"),
    "padding_and_order.block_table": PropertyRule(
        True, "columns no index reaches leave the converted indices, and so every later stage's input, unchanged"),
    "batch_invariance.batched": PropertyRule(
        True, "a request's rows are computed by their own programs, whatever else is in the batch"),
    "batch_invariance.chunked": PropertyRule(
        True, "a prefill token reads the same rows whichever chunk and workspace offset hold them"),
    "spec_decode.single_tokens": PropertyRule(
        True, "[B, s] and [B*s, 1] queries are the same rows in the same order"),
    "singleton.value": PropertyRule(
        False, "K copies of one logit: every softmax weight is exp(0) = 1 exactly, so out is the row's V summed K "
        "times in fp32 (exact) over the fp32 sum K, then rounded to bf16",
        {OUT: (Bound("bf16_units", 2.0, "one fp32 division and one bf16 rounding of V (<= 1 unit), the sink factor's fp32 "
                     "rounding on top; a count off by one of 64 moves every element by 1.6% (over 4 units)"),
               Bound("elem_bf16_units", 2.0, "the same per element: one rounding step of the row's magnitude, never "
                     "below the oracle's fp32 underflow floor (2**-126 of |V| times k valid): on the H100 (main "
                     "5fb709e) Triton and flash_mla both gave a head 0 where its sink factor was 7e-39, sink - lse = "
                     "87.8; flash_mla, normalizing at the max logit, also one of 3e-37 (sink - max_logit = 90.4)")),
         LSE: (Bound("lse_fp32_units", LSE_BOUNDS[0].limit, "the oracle's: one 576-term fp32 dot product, plus the fp32 "
                     "rounding of ln(k valid); ln 2 (a deduplicated or halved count) is millions of units"),)}),
    "stress.rerun": PropertyRule(
        True, "FlashMLA's prefill and decode were measured bitwise deterministic on the H200 and ours use fixed "
        "reduction orders: other work on the GPU changes when a kernel runs, not what it computes"),
    "layer_view.read": PropertyRule(
        True, "the kernels address a block through the cache's stride(0) and data pointer: the same bytes read the "
        "same way wherever the allocation puts them"),
    "layer_view.write": PropertyRule(True, "a writer stores each row through the cache's strides: the same bytes in "
                                     "the layer, none in its neighbours"),
    "dcp_size_one.convert_index": PropertyRule(True, "one rank owns every position: the same conversion"),
    "dcp_size_one.forward_mqa": PropertyRule(
        True, "one rank's merge weight is exp(0) = 1 and its log-sum-exp is its own LSE, exactly"),
    "dcp_size_one.merge": PropertyRule(True, "one rank: weight exp(0) = 1, L = ln(1) + lse = lse exactly"),
    "hisparse_equals_plain.layers": PropertyRule(
        True, "every row a kernel reads is a byte copy of the logical row, in the same column order, through "
        "the same kernels with the same split (bf16: HiSparse splits the launch into decode and prefill "
        "tokens, which only a batch-dependent GEMM notices: gemm_batch)"),
    "cuda_graph.replay": PropertyRule(
        True, "a replay launches the kernels the eager call launches, on the same bytes copied into the captured "
        "buffers; FlashMLA and our Triton kernels are deterministic (determinism.rerun)"),
    "cuda_graph.unpadded": PropertyRule(
        True, "padding rows (every index -1) read nothing and add nothing to a real row; a kernel whose split "
        "of the top-k depends on the batch declares split_kv (H100, 5fb709e: flash_mla and Triton decode, 5 or 3 real "
        "requests captured at 2x and 4x, one bf16 ulp apart from the eager call at the real batch; bitwise at 1x)"),
    "cuda_graph.padding": PropertyRule(
        True, "a row with no valid index is the empty row: out 0, lse +inf, max_logits -inf (both kernels, H100)"),
    "cuda_graph.reference": PropertyRule(
        False, "each replay against the float64 reference under the op's own bounds (the default and its deviations')"),
    "determinism.rerun": PropertyRule(
        True, "no atomics, fixed reduction orders (FlashMLA prefill and decode measured bitwise on the H200)"),
    "v4_union_merge.merged": PropertyRule(
        False, "the float64 merge of the two lists' bf16 outputs against one bf16 output of the union",
        _rounding_apart("CPU worst: see docs/v4.md")),
    "v4_extra_empty.no_extra": PropertyRule(
        True, "an extra list of length 0 adds no key: the same keys in the same blocks (a kernel that plans its "
        "split by the lists' widths declares split_kv)"),
    "v4_extra_empty.all_invalid": PropertyRule(
        True, "a block of -1 entries leaves the running max, sum and accumulator unchanged, exactly (a kernel that "
        "plans its split by the lengths' values declares length_plan)"),
    "v4_zero_rope.rope_unseen": PropertyRule(
        True, "q's zero RoPE dims times any finite K RoPE value are exact zeros in the fp32 dot: the logits, the "
        "softmax and every NoPE column of out are the same bits"),
    "v4_row_alone.alone": PropertyRule(
        True, "a request's rows are computed by their own programs, whatever else is in the batch (split_kv: a "
        "rounding)"),
}


def property_bounds(check: str, kind: str, deviations: Iterable[str] = ()) -> tuple[str, tuple[Bound, ...], str]:
    """(the kind to compare as, its bounds, the deviation that set them) for tensor kind `kind` of
    the property check `check` ("property.check"), given the implementation's deviations."""
    rule = PROPERTY_RULES[check]
    if kind == EXACT:
        return EXACT, EXACT_BOUNDS, ""
    for name in deviations:
        dev = DEVIATIONS.get(name)
        if dev is not None and check in dev.relaxes:
            return kind, dev.property_bounds[kind], dev.name
    if rule.bitwise:
        return EXACT, EXACT_BOUNDS, ""
    return kind, rule.bounds[kind], ""


def all_bounds() -> list[tuple[str, str, Bound]]:
    """Every bound with where it applies, for `mla-verify list --tolerances` and the docs."""
    rows = [(EXACT, "", b) for b in EXACT_BOUNDS]
    rows += [(OUT, "", b) for b in OUT_BOUNDS] + [(LSE, "", b) for b in LSE_BOUNDS]
    rows += [(OUT, f"dcp {combine} (2 ranks)", b) for combine in ("merge", "ag_rs", "a2a") for b in dcp_out_bounds(2, combine)]
    for dev in DEVIATIONS.values():
        rows += [(kind, dev.name, b) for kind, bs in dev.bounds.items() for b in bs]
        rows += [(kind, f"{dev.name} (properties)", b) for kind, bs in dev.property_bounds.items() for b in bs]
    for check, rule in PROPERTY_RULES.items():
        if rule.bitwise:
            rows.append((EXACT, check, Bound("mismatch_frac", 0.0, rule.reason)))
        rows += [(kind, check, b) for kind, bs in rule.bounds.items() for b in bs]
    return rows


# ----------------------------------------------------------------------------- drift
#
# Drift (reports.drift) compares a run with a baseline run of the same ops: did the kernel move
# away from the exact answer? It is judged on metrics that mean the same thing in every case (the
# error in units of one rounding, the bias relative to rms(ref), the share of the bound used), so
# that cases of different scales compare. Raw max_abs is shown and never judged: it tracks each
# case's magnitude, not the kernel. The numbers below are CPU measurements: gate runs of one
# revision (profile ci, ~460 rows in 117 groups, seeds 11-14 and 21-22) and 40-case fuzz campaigns
# of the torch-fp32 prefill and decode kernels (seeds 1-3) against tests.impls.drifted:v2 (the
# same prefill with a 1 + 2**-11 output gain: inside every bound, biased 4.9e-4).


@dataclass(frozen=True)
class DriftMetric:
    """A metric drift is judged on: its name, the kinds it applies to and, per kind, the floor
    below which a change is rounding residue (values are raised to the floor before any ratio)."""

    name: str
    floors: Mapping[str, float]
    reason: str


DRIFT_METRICS = (
    DriftMetric("bf16_units", {"out": 1.0, "other": 1.0},
                "one rounding of the exact answer; correct kernels sit at 0.8 (p50) to 1.3 (p90) of it"),
    DriftMetric("elem_bf16_units", {"out": 1.0, "other": 1.0},
                "the worst element's rounding step; correct kernels: p50 0.7, p90 1.3"),
    DriftMetric("lse_fp32_units", {"lse": 1.0, "max_logits": 1.0},
                "one fp32 step of the row's logit scale; correct kernels: p50 0.26, p90 0.73 (lse), 0.6 "
                "(max_logits)"),
    DriftMetric("abs_bias", {"out": 2.0**-13, "other": 2.0**-13, "lse": 2.0**-20, "max_logits": 2.0**-20},
                "|mean_err|: out p90 1.0e-4 (the mean of n unbiased bf16 roundings, ~1.7e-3/sqrt(n), 1.8e-5 at "
                "8192 elements), lse p90 6e-8 (fp32 roundings); a gain of 1 + 2**-11 biases out by 4.9e-4, 4x "
                "the floor"),
    DriftMetric("bound_use", {"out": 0.25, "other": 0.25, "lse": 0.25, "max_logits": 0.25},
                "value / bound of the row's least-headroom metric (1 / headroom); correct kernels use at most "
                "0.22 of a bound (out) and 0.05 (lse), so headroom drifts only below 4 / factor (2 at the default). "
                "The attention ops' elem_bound_ratio reaches 0.47 (out: the bf16 rounding alone is up to half its "
                "bound; CPU gate, seed 1), so against a baseline made before that bound their bound_use rises ~2x: "
                "re-baseline"),
    DriftMetric("mismatch_frac", {"exact": 0.0},
                "bit-exact contracts: any mismatch is real (and a failure)"),
)

DRIFT_FACTOR = 2.0
DRIFT_FACTOR_REASON = (
    "the median per-case ratio of two correct kernels on the same cases (Triton against torch-fp32, every op "
    "of the gate, seeds 21 and 22) is at most 1.04, one case alone reaching 2.4 (|bias|); one kernel re-run on "
    "its own cases gives exactly 1; the biased v2 kernel gives 3.2-3.9 (abs_bias), so 2 sits between them")
DRIFT_CONFIDENCE = 0.99
DRIFT_CONFIDENCE_REASON = (
    "unpaired runs of one kernel on other cases, whose raw p99 ratios reach 4.6x (decode bf16_units, 37 vs 36 "
    "cases), flagged nothing: 6 run pairs at factors 1.25, 1.5, 2 and confidences 0.9, 0.95, 0.99, and 300 "
    "subsamples of 3-20 cases a side at 0.95 and 0.99; a gate holds ~400 (group, metric) tests, and 0.99 keeps a "
    "change near the factor from flagging several by chance. Power is the price: the v2 bias is found in 36% of "
    "20 + 20-case samples at 0.99 (86% at 0.95), and at 38 + 37 cases with p = 2e-5; paired, in every run tried "
    "(6, 10, 12 cases). Re-run the baseline's seed to pair")
DRIFT_MIN_CASES = 5
DRIFT_MIN_CASES_REASON = (
    "cases per side below which an unpaired group is 'too few cases to judge': the rank test's smallest "
    "p-value is 1 / C(2n, n), 0.004 at 5 + 5 cases, 0.014 at 4 + 4 (never significant at 0.99); CPU "
    "gate groups hold 1-9 cases, most of them paired through the corpus or the baseline's seed")

# Within the factor, a group reads `worse` (or `better`) when the change is significant at
# DRIFT_CONFIDENCE and material: reports/words.py.
WORSE_MEDIAN = 1.1
WORSE_MEDIAN_REASON = (
    "the median per-case ratio that counts as worse once the sign test of the cases that moved is significant: "
    "two correct kernels on the same cases (Triton against torch-fp32) differ by at most 1.04, a rerun of one "
    "kernel by exactly 1")
WORSE_TAIL = 1.25
WORSE_TAIL_REASON = (
    "a case moved by this factor (or 1 / it) counts toward the tail test (paired: more cases up than down, sign "
    "test; unpaired: the rank test of new > 1.25 x old). Unpaired runs of one kernel on other cases flagged nothing at factor 1.25 (DRIFT_CONFIDENCE's "
    "measurement); the decode kernel that rounds its softmax weights to bf16 (tests.impls.decode_versions:v2) "
    "moves 15 of 39 cases' out bf16_units up by 1.25x or more and none down (p = 3e-5), while its median ratio, "
    "1.07, stays inside WORSE_MEDIAN")
TAIL_QUANTILE = 0.8
TAIL_QUANTILE_REASON = (
    "the unpaired tail test (cases of one run only) counts the cases above the two runs' pooled p80, Fisher's exact "
    "test, material when the p90 moved by WORSE_TAIL, at 1 - confidence shared over the group's metrics. 40-case "
    "decode campaigns at 20 seeds, every ordered pair of other seeds: v2 (P rounded to bf16) against v1 worse in "
    "380 of 380 (out, p ~ 5e-6), v1 against v1 worse in 2 and better in 2 of 380 (out; lse the same); the pooled "
    "p90 found v2 as often and v1 worse in 10 of 380 (lse). It reaches its level from 21 cases a side")
WORSE_BIAS_SHARE = 0.5
WORSE_BIAS_SHARE_REASON = (
    "a bias metric's shift reads worse when its whole t interval lies beyond this share of the floor (drift: "
    "beyond the floor), moving away from 0: a reseeded rerun's shifts stay far inside (tests/test_bias.py)")


DRIFT_DEFAULTS = (
    ("--factor", DRIFT_FACTOR, DRIFT_FACTOR_REASON),
    ("--confidence", DRIFT_CONFIDENCE, DRIFT_CONFIDENCE_REASON),
    ("--min-cases", DRIFT_MIN_CASES, DRIFT_MIN_CASES_REASON),
    ("worse median", WORSE_MEDIAN, WORSE_MEDIAN_REASON),
    ("worse tail", WORSE_TAIL, WORSE_TAIL_REASON),
    ("tail quantile", TAIL_QUANTILE, TAIL_QUANTILE_REASON),
    ("worse bias", WORSE_BIAS_SHARE, WORSE_BIAS_SHARE_REASON),
)


def drift_metrics(kind: str) -> tuple[DriftMetric, ...]:
    """The drift metrics that apply to tensors of `kind` (reports.kinds)."""
    return tuple(m for m in DRIFT_METRICS if kind in m.floors)


# ----------------------------------------------------------------------------- bias
#
# Bias (reports.bias, and drift's signed metrics) asks whether a kernel errs the same way in case
# after case: a gain, a truncated scale, a dropped rounding step, a biased exp. Rounding to nearest
# errs both ways and averages out over a tensor; a bias does not, and it compounds across a model's
# 61 layers. Each case's statistic (its row's `gain` or `bias_units`) is one sample: the elements of
# a case share its softmax weights, its keys and its scales, so they are not independent samples,
# but cases (seeds drawn apart) are. A group (op, path, tensor, implementation) is judged on the
# mean over its cases, with a Student t interval at the drift confidence: paired on the per-case
# differences new - baseline, unpaired by Welch's test, alone (no baseline) against 0. It flags
# when the whole interval lies beyond the floor: significant at the confidence AND larger than the
# floor there (a one-sided test of |shift| > floor). The floor is a fraction of the tensor's
# rounding unit: below it, correct kernels differ systematically (their sm_scale and exp roundings),
# which many cases resolve and no one should chase; and a group of a few noisy cases whose mean
# lands past the floor by chance (a gate holds ~200 such tests) is not enough, its interval reaches
# back inside.


@dataclass(frozen=True)
class BiasMetric:
    """A signed per-case statistic, the kinds it applies to and, per kind, the floor: the least
    |mean| (alone) or |mean shift| (against a baseline) that counts as bias, with its reason."""

    name: str
    unit: str
    floors: Mapping[str, float]
    reason: str


BIAS_METRICS = (
    BiasMetric("gain", "relative", {"out": 2.0**-13, "other": 2.0**-13},
               "u / 32 with u = 2**-8 the bf16 unit roundoff: a gain that size moves every element by 1/32 of "
               "its rounding and compounds to 0.7% (2 u) across 61 layers. Correct kernels lean less: torch-fp32 "
               "sparse_prefill means +0.5e-5 to +7.4e-5 over 60 cases (ci profile, seeds 27-34; always positive, a "
               "real lean of ~2**-14.4, a third of the floor), Triton +1.4e-5 (seed 5); decode (seed 5): torch-fp32 "
               "-1.9e-5 +- 7.1e-5, Triton -3.0e-5 +- 1.2e-4. "
               "A 2**-10 gain (u / 4) measures 2**-10.9 (bf16-exact outputs, a peaked softmax's, round back and hide "
               "part of it): paired against its correct twin, shifts of 3.7e-4 to 5.9e-4, the 0.99 interval's lower "
               "end at least 2.2e-4, 1.8x the floor (2**-11: 1.7e-4 to 3.1e-4, found in 4 of 8 seeds)"),
    BiasMetric("bias_units", "bf16 ulp (out), fp32 step of the logit scale (lse)",
               {"out": 1 / 16, "other": 1 / 16, "lse": 2.0, "max_logits": 2.0},
               "out: 1/16 of a bf16 step at the element's magnitude (correct kernels: |mean| <= 0.005, intervals "
               "<= 0.035 at 25-60 cases); lse and max_logits: 2 fp32 steps of the logit scale, because a correct "
               "kernel is allowed that much: sm_scale rounded to fp32 (2**-24 relative) and the fp32 product "
               "sm_scale * log2(e) each scale every logit of a case the same way, by up to one step each (CPU: "
               "torch-fp32 and Triton means -0.01 to +0.07 steps). An LSE offset of 4 steps measures 3.99-4.00 "
               "(intervals +-0.02 at 60 cases), twice the floor"),
)


def bias_metrics(kind: str) -> tuple[BiasMetric, ...]:
    """The bias metrics that apply to tensors of `kind` (reports.kinds)."""
    return tuple(m for m in BIAS_METRICS if kind in m.floors)
