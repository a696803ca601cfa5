"""hisparse_equals_plain: the HiSparse path and the plain path of one implementation agree bit for bit.

    layers   every layer of a HiSparse group (host cache, hot slots, swap-in, staged prefill rows,
             resident path, persistent buffer or its fallback) against the plain pipeline on that
             layer's logical cache and query: out and LSE, the layers' rows concatenated.
HiSparse relocates rows; every row a kernel reads is a byte copy of a logical one, in the same
column order (stable compaction), so the same kernels see the same bytes. Two conditions keep
the work identical and are drawn so: bf16 runs the same BF16 kernel over every token either
way; fp8 (heads >= 32) needs the same decode/prefill split on both sides, so prefills are longer
than the plain threshold, and -1 only trails a row (no invalid-index patterns) (HiSparse's FP8 decode keeps -1 in place where
the plain separate path compacts, which moves valid entries when -1 is interleaved).
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from mla_verify.equivalence.cases.hisparse_batch import make_hisparse_batch
from mla_verify.equivalence.judge.policy import LSE, OUT
from mla_verify.optimized import hisparse, pipeline

from mla_verify.reference.metadata import reorder_batch_threshold
from ..cases import cost
from ..cases.draws import hisparse_params, within_budget
from ..cases.params import ForwardParams
from ..cases.profiles import Profile
from ..spec import register
from ..sandbox.produced import Compared
from .base import PropertySpec, Target
from .common import forward_knobs, forward_scale

UNDER_TEST = ("convert_index", "hisparse_place", "hisparse_swap_in", "hisparse_prefill_plan", "stage_prefill_rows",
              "gather_fp8_prefill", "index_group", "sparse_prefill", "sparse_decode_fp8", "gather_upconvert_fp8")


def _stages(p: ForwardParams) -> list[str]:
    plain = pipeline.needed_stages(p.cache_dtype, p.heads)
    return list(dict.fromkeys([*hisparse.needed_stages(p.cache_dtype), *plain]))


def _inputs(p: ForwardParams, seed: int, device: str) -> dict:
    return {"batch": make_hisparse_batch(p, seed, device)}


def _check(kw: dict, p: ForwardParams, stages) -> list:
    b = kw["batch"]
    metadata = b.plain.metadata(pipeline.MQAMetadata)
    got = hisparse.forward_mqa_hisparse(b.q_layers, b.host_caches, b.gpu_rows, b.plain.topk_indices, metadata,
                                        b.hisparse_tables(hisparse.HiSparseTables), b.group_buffer, stages)
    base = [pipeline.forward_mqa(q, cache, b.plain.topk_indices, metadata, stages)
            for q, cache in zip(b.q_layers, b.plain_caches)]
    # Layer 0's key norms stand in for every layer's (rows of one distribution): a unit, not a bound.
    scale = torch.cat([forward_scale(dataclasses.replace(b.plain, q=q), p.sm_scale) for q in b.q_layers])
    return [Compared("layers", "out", OUT, torch.cat([r.out for r in got]), torch.cat([r.out for r in base])),
            Compared("layers", "lse", LSE, torch.cat([r.lse for r in got]), torch.cat([r.lse for r in base]), scale)]


@st.composite
def _like_plain(draw, p: Profile) -> dict:
    """fp8 HiSparse batches the plain separate path splits the same way: 32 heads on sm90, prefills
    longer than its threshold, and -1 only at the tail of a top-k row (no invalid-index patterns:
    each of them, duplicates too, leaves -1 or an out-of-range entry between valid ones)."""
    d = draw(hisparse_params(p, "fp8_separate_hisparse", heads=(32,)))
    s = d["max_decode_query_len"]
    longer = reorder_batch_threshold(32, "sm90", max_decode_query_len=s) + draw(st.integers(0, 8))
    qlens = [n if n == s else longer + n for n in d["query_lens"]]
    if p.budget_s is not None:  # the interpreter: the layers and long prefills the budget holds, at least one
        d, qlens = _within_interpreter(d, qlens, p.budget_s)
    seq_max = max(c + n for c, n in zip(d["context_lens"], qlens))
    ws = d["workspace_size"]
    return within_budget({**d, "query_lens": qlens, "arch": "sm90", "invalid": [], "max_model_len": seq_max,
                          "buffer_rows": min(d["buffer_rows"], sum(qlens) + 2),
                          "workspace_size": None if ws is None else max(ws, seq_max)})


def _within_interpreter(d: dict, qlens: list[int], budget_s: float) -> tuple[dict, list[int]]:
    """`d` with fewer layers, then fewer prefills (the last first, one kept while there are no
    decodes), then top-k 128, until its two runs (HiSparse and plain) estimate within `budget_s`
    under the interpreter (equivalence.cases.cost); a case still over it is drawn again (the
    campaign's filter)."""
    def estimate(d: dict, qlens: list[int]) -> float:
        return cost.interpreted_s(ForwardParams.of({**d, "query_lens": qlens, "arch": "sm90"}), runs=2)

    decodes = qlens.count(d["max_decode_query_len"])
    while estimate(d, qlens) > budget_s and d["layers"] > 1:
        d = {**d, "layers": d["layers"] - 1}
    while estimate(d, qlens) > budget_s and len(qlens) > max(1, decodes + 1):
        qlens, d = qlens[:-1], {**d, "context_lens": d["context_lens"][:-1]}
    if estimate(d, qlens) > budget_s:
        d = {**d, "topk": 128, "hot_slack": min(d["hot_slack"], 128)}
    if estimate(d, qlens) > budget_s and decodes and len(qlens) > decodes:
        qlens, d = qlens[:decodes], {**d, "context_lens": d["context_lens"][:decodes]}
    return d, qlens


register(PropertySpec(
    short="hisparse_equals_plain",
    checks=("layers",),
    targets={"forward_mqa": Target("forward_mqa", _stages, UNDER_TEST, _inputs, _check, forward_knobs,
                                   lambda p: st.one_of(hisparse_params(p, "bf16_hisparse"), _like_plain(p)))},
    doc="every layer of a HiSparse group equals the plain path on its logical cache, bit for bit",
), priority=108)
