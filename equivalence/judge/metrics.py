"""How far an implementation's tensor is from the reference's: the numbers every row carries.

Three kinds of tensor, three ways of measuring:
* exact (cache bytes, indices, bf16 values a contract fixes bit for bit): fraction of elements
  that differ, bit for bit (NaN payloads included);
* out (an attention output, bf16 against the float64 reference):
    rel_l2          ||a - r|| / ||r||
    cos_dist        1 - <a, r> / (||a|| ||r||)
    bf16_units      ||a - r|| / ||bf16(r) - r||: the error in units of rounding the exact answer
                    to bf16, the least any bf16 output can do (the unit never drops below
                    2**-10 ||r||, for answers that happen to be bf16-representable)
    elem_bf16_units max |a - r| / max(2**-8 * max|r| over the row's last dim, 2**-126 * value_max):
                    the worst element in bf16 rounding steps of its own row's magnitude. The
                    floor is where fp32 arithmetic underflows: a weight below the smallest normal
                    float32 flushes to zero (FTZ), so a row whose weights all sit there (a sink
                    ~87 nats above the LSE or the max logit) may come out 0; value_max (the largest
                    |V| the row averages, times e^(lse - max_logit) for a kernel normalizing by the
                    max logit; 1 when unknown) is what such a weight multiplies
    mean_err        mean of (a - r) / r over the elements at least 2**-8 of their row's largest:
                    the signed relative bias, each element weighing the same (large outlier
                    channels do not dominate it). Rounding to nearest averages out
                    (~2**-8 / sqrt(3 n)); a wrong scale, a lost softmax mass or a biased
                    dequantization shows as a steady sign
    elem_bound_ratio max |a - r| / bound over the finite elements, where the op's reference derives a
                    per-element bound (equivalence.judge.bounds): <= 1 for any correct kernel (0 / 0 is 0;
                    an error where the bound is 0, an empty row's output, is inf)
    bias_units      mean of (a - r) / ulp_bf16(r) over the same sizable elements: the signed error in
                    bf16 steps at each element's magnitude (ulp = 2**(e - 8) for |r| in [2**(e-1), 2**e)).
                    It sees an offset; the gain below sees a scale (for which the signs of r cancel here)
* every float kind:
    gain            <a - r, r> / <r, r>: the least-squares gain of a = (1 + gain) r + noise (out: over
                    the sizable elements, as mean_err; a row flushed to zero below the FTZ floor has
                    no gain to measure; NaN where no element qualifies)
    gain_se         its standard error, each row (out: vector along the last dim; lse: element) a
                    cluster: sqrt(G / (G - 1) * sum_rows <e_row, r_row>**2) / <r, r> with e = d - gain r.
                    The errors of one row share its softmax weights' roundings, so they are not
                    independent; rows are nearly so. NaN below 2 rows
* lse and max_logits (fp32 against float64):
    mean_err        (for these, the signed gain <a - r, r> / <r, r>)
    lse_fp32_units  max |a - r| / (2**-24 * (logit_l1 + |r| + 1)): the worst error in fp32 rounding
                    steps of the row's logit scale (logit_l1 = max_j sm_scale * sum_d |q_d K_jd|,
                    what an fp32 dot product's rounding error grows with)
    elem_bound_ratio as for out, against the derived LSE (max_logits) bound
    bias_units      mean of (a - r) / (2**-24 * (logit_l1 + |r| + 1)): the signed error in the same
                    fp32 steps, which the roundings of a correct kernel leave near 0
Both float kinds compare NaN and infinities by position first: +inf, -inf and NaN must sit in
exactly the reference's places (`inf_mismatch` counts the positions that differ) and NaN the
reference does not have is counted in `nan_count`. The other metrics use the positions where
both are finite.

The float kinds measure a block of C tensors of one shape at once (`outputs`, `lses`: the cases of
a fuzz block, which differ only in their seed), each case on its own, with one read back to the
host for the block; `output` and `lse` are the block of one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import fused as fused_judge

BF16_UNIT = 2.0**-8    # unit roundoff of bf16 (8 significant bits)
FP32_UNIT = 2.0**-24
FP32_TINY = 2.0**-126  # smallest normal float32: GPU fp32 math flushes below it (a sink can push a row there)


Position = tuple[int, ...]  # an element's index in its tensor


@dataclass
class Metrics:
    """One tensor's distance from the reference's. Each field is a column of the tensor's row
    (equivalence.judge.rows), but those only the oracle's verdict reads (rows, shape, extra)."""

    numel: int = 0                # elements compared
    rows: int = 0                 # vectors along the last dim (independent softmax rows of an output)
    ref_rms: float = math.nan     # rms of the reference over finite positions: the magnitude the error sits on
    rel_l2: float = math.nan      # ||impl - ref|| / ||ref|| over finite positions
    cos_dist: float = math.nan    # 1 - cos(impl, ref)
    max_abs: float = math.nan     # max |impl - ref| over finite positions (exact: at the first mismatch)
    max_abs_at: Position = ()     # index of that element, one coordinate a dim
    mismatch_frac: float = math.nan  # fraction failing the per-element abs-or-rel check (exact: not bit-equal)
    mean_err: float = math.nan    # signed relative bias (lse: gain): a bug biases, rounding does not
    bf16_units: float = math.nan  # ||impl - ref|| / ||bf16(ref) - ref||: error in units of bf16 rounding
    elem_bf16_units: float = math.nan  # worst element, in bf16 rounding steps of its row's magnitude
    lse_fp32_units: float = math.nan   # worst LSE error, in fp32 rounding steps of its row's logit scale
    elem_bound_ratio: float = math.nan  # worst element's error / its derived bound (NaN: no bound derived)
    gain: float = math.nan        # least-squares gain <impl - ref, ref> / <ref, ref>: a scale error's size
    gain_se: float = math.nan     # its standard error, rows as clusters (NaN below 2 rows)
    bias_units: float = math.nan  # mean signed error in rounding units (out: bf16 ulps; lse: fp32 steps)
    nan_count: int = 0            # NaN in the implementation's output where the reference has none
    inf_mismatch: int = 0         # positions whose +inf / -inf / NaN pattern differs from the reference
    shape: str = ""               # the shapes (and dtypes) that do not match, "A vs B"; "": they match
    extra: dict = field(default_factory=dict)  # "first_mismatch" (exact)


def position(flat_index: int, shape: torch.Size) -> Position:
    """The index of the element at `flat_index` of a row-major tensor of `shape`."""
    coords = []
    for size in reversed(shape):
        coords.append(flat_index % size)
        flat_index //= size
    return tuple(reversed(coords))


def exact(a: torch.Tensor, r: torch.Tensor) -> Metrics:
    """Bit-for-bit comparison (shapes must match; float tensors compare their bits)."""
    if a.shape != r.shape or a.dtype != r.dtype:
        return Metrics(numel=r.numel(), mismatch_frac=1.0, shape=f"{tuple(a.shape)} {a.dtype} vs {tuple(r.shape)} {r.dtype}")
    if a.is_floating_point():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a_bits, r_bits = a.contiguous().view(bits), r.contiguous().view(bits)
    else:
        a_bits, r_bits = a, r
    diff = (a_bits != r_bits).flatten()
    m = Metrics(numel=r.numel(), mismatch_frac=float(diff.float().mean()) if r.numel() else 0.0)
    if a.is_floating_point():
        m.nan_count = int((torch.isnan(a) & ~torch.isnan(r)).sum())
    if bool(diff.any()):
        first = int(diff.nonzero()[0])
        m.max_abs_at = position(first, r.shape)
        av, rv = a.flatten()[first], r.flatten()[first]
        m.max_abs = float((av.double() - rv.double()).abs()) if a.is_floating_point() or a.dtype != torch.bool else 1.0
        m.extra["first_mismatch"] = f"{av.item()} vs {rv.item()}"
    else:
        m.max_abs = 0.0
    return m


def _flat(x: torch.Tensor) -> torch.Tensor:
    """A block [C, ...] as [C, n]: one case a row (reshape(C, -1) cannot size an empty case)."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))


def _sum(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each case's sum, [C]."""
    return _flat(x).sum(dim=1, dtype=dtype)


def _dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each case's <x, y>, [C]."""
    return torch.linalg.vecdot(_flat(x), _flat(y))


def _finite(x: torch.Tensor) -> torch.Tensor:
    """isfinite in two passes instead of four: x - x is 0 exactly where x is finite, NaN elsewhere."""
    return torch.sub(x, x).eq(0)


def _classes(x: torch.Tensor) -> torch.Tensor:
    """One code per class, comparable across tensors: 0 finite, NaN -> 2, +inf, -inf."""
    return torch.where(_finite(x), 0, x).nan_to_num_(nan=2.0, posinf=math.inf, neginf=-math.inf)


def _first(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(largest element, its flat position in the case: the first on ties) of each case of x, in
    one reduction."""
    if x.numel() == 0:
        return x.new_zeros(x.shape[0]), torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    return _flat(x).max(dim=1)


def _float_stats(a: torch.Tensor, r: torch.Tensor, extra, shape: torch.Size) -> list[tuple[Metrics, dict[str, float]]]:
    """The metrics every float kind shares, per case of the block a, r [C, ...], plus the kind's
    own scalars (`extra(d, rf, abs_d)` -> name: [C] tensor), reduced on the device and read back
    in one transfer for all cases; positions index within `shape`, the case's. d = a - r and
    rf = r where both are finite, 0 elsewhere."""
    d = torch.sub(a if a.is_floating_point() else a.double(), r)  # a promoted as read: no float64 copy
    finite = _finite(d)
    d.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # zero exactly where d is not finite
    rf = torch.where(finite, r, 0.0)
    abs_d = d.abs()
    max_abs, argmax = _first(abs_d)
    # Counts summed in float64 (exact below 2**53): only the positions need converting to be stacked.
    stats = {"n": _sum(finite, torch.float64), "ref_sq": _dot(rf, rf), "err_sq": _dot(d, d), "dot": _dot(d, rf),
             "max_abs": max_abs, "argmax": argmax, **extra(d, rf, abs_d)}
    return _case_stats(a, r, stats, shape)


def _case_stats(a: torch.Tensor, r: torch.Tensor, stats: dict[str, torch.Tensor],
                shape: torch.Size) -> list[tuple[Metrics, dict[str, float]]]:
    """Each case's Metrics begun and its scalars from `stats` (name: [C] tensor), read back in one
    transfer; the +inf/-inf/NaN classes are compared in a second pass, once for the block, only
    when some element of some case is not finite."""
    cases = [dict(zip(stats, row)) for row in torch.stack([v.double() for v in stats.values()], dim=1).tolist()]
    numel = math.prod(shape)
    classes = [(0, 0)] * len(cases)
    if any(v["n"] < numel for v in cases):
        ca, cr = _classes(a), _classes(r)
        classes = torch.stack([_sum(ca != cr), _sum((ca == 2) & (cr != 2))], dim=1).tolist()
    out = []
    for v, (inf_mismatch, nan_count) in zip(cases, classes):
        m = Metrics(numel=numel, inf_mismatch=inf_mismatch, nan_count=nan_count)
        v["ref_norm"], v["err_norm"] = math.sqrt(v["ref_sq"]), math.sqrt(v["err_sq"])
        if v["n"]:
            m.ref_rms = v["ref_norm"] / math.sqrt(v["n"])
            m.max_abs = v["max_abs"]
            m.max_abs_at = position(int(v["argmax"]), shape)
            m.rel_l2 = v["err_norm"] / v["ref_norm"] if v["ref_norm"] else (math.inf if v["err_norm"] else 0.0)
        out.append((m, v))
    return out


def _gain_terms(d: torch.Tensor, rf: torch.Tensor, rows_last: bool) -> dict[str, torch.Tensor]:
    """The gain's standard error terms as `extra` scalars: per cluster (a row along the last dim,
    or each element) its <d, r> and <r, r>, reduced to sum_c <e_c, r_c>**2 with e = d - gain r."""
    dr, rr = (torch.linalg.vecdot(d, rf), torch.linalg.vecdot(rf, rf)) if rows_last else (d * rf, rf * rf)
    dot, sq = _sum(dr), _sum(rr)
    gain = dot / sq.clamp(min=torch.finfo(torch.float64).tiny)
    score = dr - gain.reshape(-1, *[1] * (dr.dim() - 1)) * rr
    return {"gain_dot": dot, "gain_sq": sq, "score_sq": _dot(score, score), "clusters": _sum(rr > 0, torch.float64)}


def _set_gain(m: Metrics, v: dict[str, float]) -> None:
    """gain and gain_se from `_gain_terms`' scalars: NaN where no element took part."""
    if not v["gain_sq"]:
        return
    m.gain = v["gain_dot"] / v["gain_sq"]
    g = v["clusters"]
    m.gain_se = math.sqrt(g / (g - 1) * v["score_sq"]) / v["gain_sq"] if g >= 2 else math.nan


def _bound_ratio(abs_d: torch.Tensor, bound: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """elem_bound_ratio as an `extra` scalar: max |d| / bound, 0 where d is."""
    if bound is None:
        return {}
    ratio = torch.where(abs_d > 0, abs_d / bound.to(abs_d.device, torch.float64), 0.0)
    return {"bound_ratio": _first(ratio)[0]}


def _set_bound_ratio(m: Metrics, v: dict[str, float]) -> None:
    if "bound_ratio" in v:
        m.elem_bound_ratio = v["bound_ratio"] if v["n"] else 0.0


def _one(x: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor as a block of one case."""
    return None if x is None else x[None]


def outputs(a: torch.Tensor, r: torch.Tensor, elem_units: float, value_max: torch.Tensor | None = None,
            bound: torch.Tensor | None = None, fused: bool = False) -> list[Metrics]:
    """Attention outputs (bf16 or wider) against the float64 reference, a block of C >= 1 cases
    of one shape: `a`, `r` [C, ...]; `elem_units` is the per-element bound (in bf16 steps of the
    row's magnitude) that `mismatch_frac` counts against; `value_max` ([C, ...] without r's last
    dim) the largest |V| each row averages; `bound` (r's shape) the derived per-element bound,
    for elem_bound_ratio. Every metric is its case's own; positions index within the case.
    `fused`: the scalars from the fused judge's kernel (`equivalence.judge.fused`) where it fits."""
    shape = r.shape[1:]
    if not shape:  # a 0-d case is one row of one element
        a, r, bound = a[:, None], r[:, None], None if bound is None else bound[:, None]
    r = r.double()
    rows = math.prod(shape) // max(shape[-1], 1) if shape else 1
    if fused and fused_judge.fits(a, r):
        vmax = None if value_max is None else value_max.expand(r.shape[:-1])
        stats = fused_judge.output_stats(a, r, elem_units, vmax, bound)
        return [_output(m, v, rows, shape) for m, v in _case_stats(a, r, stats, shape)]

    def extra(d, rf, abs_d):
        abs_r = rf.abs()
        row_scale = output_row_scale(abs_r, value_max)
        elem = _row_worst(abs_d, row_scale)
        sizable = abs_r >= row_scale  # row_scale > 0: never a zero or a non-finite position
        rounding = torch.sub(rf.to(torch.bfloat16), rf)
        _, exponent = torch.frexp(rf)   # |r| in [2**(e-1), 2**e): one bf16 step there is 2**(e - 8)
        return {
            "rounding_sq": _dot(rounding, rounding), "elem": elem,
            "beyond": _sum(abs_d > elem_units * row_scale, torch.float64),
            "rel_sum": _sum(torch.where(sizable, d / rf, 0.0)), "rel_n": _sum(sizable, torch.float64),
            "ulp_sum": _sum(torch.where(sizable, torch.ldexp(d, 8 - exponent), 0.0)),
            **_gain_terms(torch.where(sizable, d, 0.0), torch.where(sizable, rf, 0.0), rows_last=True),
            **_bound_ratio(abs_d, bound),
        }

    return [_output(m, v, rows, shape) for m, v in _float_stats(a, r, extra, shape)]


def _output(m: Metrics, v: dict[str, float], rows: int, shape: torch.Size) -> Metrics:
    """One case's output metrics from its scalars."""
    m.rows = rows
    _set_bound_ratio(m, v)
    if not v["n"]:
        return m
    # 1 - cos(a, r) from d = a - r without cancellation: |a|^2 |r|^2 - <a, r>^2 = |d|^2 |r|^2 - <d, r>^2.
    a_sq, a_dot_r = v["err_sq"] + 2 * v["dot"] + v["ref_sq"], v["dot"] + v["ref_sq"]
    norms = math.sqrt(max(a_sq, 0.0) * v["ref_sq"])
    cross = max(v["err_sq"] * v["ref_sq"] - v["dot"] ** 2, 0.0)
    m.cos_dist = cross / (norms * (norms + a_dot_r)) if norms + a_dot_r > 0 else (1.0 - a_dot_r / norms if norms else float(a_sq != v["ref_sq"]))
    rounding = max(math.sqrt(v["rounding_sq"]), 2.0**-10 * v["ref_norm"])
    m.bf16_units = v["err_norm"] / rounding if rounding else (0.0 if v["err_norm"] == 0 else math.inf)
    m.mean_err = v["rel_sum"] / v["rel_n"] if v["rel_n"] else 0.0
    m.bias_units = v["ulp_sum"] / v["rel_n"] if v["rel_n"] else 0.0
    _set_gain(m, v)
    m.elem_bf16_units = v["elem"]
    m.mismatch_frac = v["beyond"] / m.numel
    return m


def output(a: torch.Tensor, r: torch.Tensor, elem_units: float, value_max: torch.Tensor | None = None,
           bound: torch.Tensor | None = None) -> Metrics:
    """One attention output's `outputs`: `value_max` r's shape without its last dim, `bound` r's."""
    return outputs(a[None], r[None], elem_units, _one(value_max), _one(bound))[0]


def output_row_scale(abs_r: torch.Tensor, value_max: torch.Tensor | None = None) -> torch.Tensor:
    """elem_bf16_units' unit of each row (keepdim): 2**-8 * max |r| over the last dim, at least
    2**-126 * value_max (`abs_r`: |r|, 0 where not finite)."""
    floor = FP32_TINY if value_max is None else FP32_TINY * value_max.to(abs_r.device).double().clamp(min=1.0)[..., None]
    return abs_r.amax(dim=-1, keepdim=True).mul_(BF16_UNIT).clamp_(min=floor)


def lse_unit(rf: torch.Tensor, logit_l1: torch.Tensor) -> torch.Tensor:
    """lse_fp32_units' unit of each element: 2**-24 * (logit_l1 + |r| + 1)."""
    return FP32_UNIT * (logit_l1.double() + rf.abs() + 1.0)


def _row_worst(abs_d: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """max |d| / row_scale of each case [C, ..., width], with one pass over |d|: the scale is per row."""
    if abs_d.numel() == 0:
        return _first(abs_d)[0]
    cases, width = abs_d.shape[0], abs_d.shape[-1]
    return (abs_d.reshape(cases, -1, width).amax(dim=-1) / row_scale.reshape(cases, -1)).amax(dim=1)


def lses(a: torch.Tensor, r: torch.Tensor, logit_l1: torch.Tensor, bound: torch.Tensor | None = None) -> list[Metrics]:
    """LSEs (or max_logits) against the float64 reference, a block of C >= 1 cases of one shape
    (`a`, `r`, `logit_l1` [C, ...]), each element scaled by its row's logit scale; `bound` (r's
    shape) the derived per-element bound, for elem_bound_ratio. Every metric is its case's own;
    positions index within the case."""
    r = r.double()

    def extra(d, rf, abs_d):
        scale = lse_unit(rf, logit_l1)
        return {"units": _flat(abs_d / scale).amax(dim=1) if d.numel() else _sum(d), "signed_units": _sum(d / scale),
                **_gain_terms(d, rf, rows_last=False), **_bound_ratio(abs_d, bound)}

    return [_lse(m, v, r.shape[1:]) for m, v in _float_stats(a, r, extra, r.shape[1:])]


def _lse(m: Metrics, v: dict[str, float], shape: torch.Size) -> Metrics:
    """One case's LSE metrics from its scalars."""
    m.lse_fp32_units = v["units"] if v["n"] else 0.0
    _set_bound_ratio(m, v)
    _set_gain(m, v)
    if v["n"]:
        m.mean_err = v["dot"] / v["ref_sq"] if v["ref_sq"] else 0.0
        m.bias_units = v["signed_units"] / v["n"]
    return m


def lse(a: torch.Tensor, r: torch.Tensor, logit_l1: torch.Tensor, bound: torch.Tensor | None = None) -> Metrics:
    """One LSE's (or max_logits') `lses`."""
    return lses(a[None], r[None], logit_l1[None], _one(bound))[0]
