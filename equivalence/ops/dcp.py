"""The DCP ops: `dcp_merge`, the combine alone (per-rank partials merged by log-sum-exp, AG+RS
semantics), and `dcp`, the whole protocol run by real rank processes (`equivalence.ops.dcp_ranks`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from mla_verify import reference
from mla_verify.equivalence.judge import bounds
from mla_verify.equivalence.cases.batch import make_batch
from mla_verify.equivalence.sandbox.call_guards import returned
from mla_verify.equivalence.sandbox.device import device_type
from mla_verify.equivalence.judge.policy import LSE, OUT

from ..cases.draws import batch_params, merge_params
from ..cases.layouts import LAYOUTS, drawn, relayout
from ..cases.params import COMBINES, WORLD_SIZES, DcpParams
from ..cases.profiles import Profile
from ..cases.schema import HEADS, Flag, Int, OneOf, Params, Real, param
from ..spec import register
from .base import BoundKey, Check, ImplOutput, OpSpec
from .common import generator, knobs, rand
from .pipeline import PipelineSpec


@dataclass(frozen=True)
class MergeParams(Params):
    """Partials of T tokens and H heads from each of `ranks` ranks."""

    ranks: int = param(Int(1, 64))
    tokens: int = param(Int(1, 2**20))
    heads: int = param(HEADS)
    empty_frac: float = param(Real(0, 1), 0.0)  # partials of ranks owning none of a token's keys
    junk: bool = param(Flag(), False)           # undefined partials (NaN or +inf LSE) the combine must drop
    layout: str = param(OneOf(*LAYOUTS), "contiguous")  # of outs and lses (equivalence.cases.layouts)

    def elements(self) -> int:
        return self.ranks * self.tokens * self.heads * 1026


def _merge_inputs(p: MergeParams, seed: int, device: str) -> dict:
    g = generator(seed, device)
    ranks, tokens, heads = p.ranks, p.tokens, p.heads
    outs = torch.randn((ranks, tokens, heads, 512), generator=g, device=device)
    lses = 4 + 3 * torch.randn((ranks, tokens, heads), generator=g, device=device)
    # Neutralized rows (a rank owning none of a token's keys) are the merge's identity (0, -inf).
    empty = rand(g, ranks, tokens) < p.empty_frac
    empty[:, rand(g, tokens) < p.empty_frac / 2] = True  # some tokens empty on every rank
    outs[empty] = 0.0
    lses[empty] = -math.inf
    if p.junk:
        # Undefined partials the combine must drop: NaN or +inf LSE with a NaN output.
        junk = (rand(g, ranks, tokens, heads) < 0.1) & ~empty[..., None]
        lses[junk] = torch.where(rand(g, int(junk.sum())) < 0.5, math.nan, math.inf)
        outs[junk] = math.nan
    return relayout("dcp_merge", {"outs": outs.to(torch.bfloat16), "lses": lses}, p.layout)


def _lse_text(v: float) -> str:
    return "NaN" if math.isnan(v) else "+inf" if v == math.inf else "-inf" if v == -math.inf else f"{v:.4g}"


def _merge_nan_inputs(kw: dict, tensor: str, got: torch.Tensor, want: torch.Tensor) -> str:
    """The inputs behind the merge's first NaN that the reference lacks: the ranks' LSEs at that
    (token, head), and what they are (every rank -inf: a token no rank holds a key of, which merges
    to out 0 and LSE -inf; a rank's +inf or NaN: an undefined partial the combine must drop)."""
    nan = torch.isnan(got.to(want.device)) & ~torch.isnan(want)
    nan = nan.any(-1) if tensor == "out" else nan                               # [T, H]
    if not bool(nan.any()):
        return ""
    t, h = (int(i) for i in nan.nonzero()[0])
    lses = kw["lses"][:, t, h].double().tolist()
    outs_nan = torch.isnan(kw["outs"][:, t, h].float()).any(-1).tolist()
    said = []
    if all(v == -math.inf for v in lses):
        said.append("every rank's LSE is -inf (no rank holds a key of it: it merges to out 0, LSE -inf)")
    odd = [f"rank {r}'s LSE is {_lse_text(v)}" + (" and its out NaN" if outs_nan[r] else "")
           for r, v in enumerate(lses) if math.isnan(v) or v == math.inf]
    if odd:
        said.append(", ".join(odd) + " (an undefined partial: the combine drops it)")
    quoted = ", ".join(_lse_text(v) for v in lses)
    return (f"at token {t}, head {h} the ranks' LSEs are [{quoted}]" + (f": {'; '.join(said)}" if said else "")
            + f" ({int(nan.sum())} of {nan.numel()} (token, head) positions hold such a NaN)")


def _merge_reference(kw, p):
    out, lse = reference.dcp_merge(kw["outs"], kw["lses"])
    # The derived per-element bounds (equivalence.judge.bounds section 3): a merge of bf16 per-rank terms
    # (upstream's) and an fp32 one both sit within them.
    out_bound, lse_bound = bounds.dcp_merge_bounds(kw["outs"], kw["lses"], out, lse)
    return {"out": out, "lse": lse, "logit_l1": torch.zeros_like(lse), BoundKey("out_bound"): out_bound,
            BoundKey("lse_bound"): lse_bound}


DCP_MERGE = register(OpSpec(
    name="dcp_merge",
    stage="dcp_merge",
    params=MergeParams,
    draw=lambda p: merge_params(p, layout=st.sampled_from(drawn("dcp_merge"))),
    inputs=_merge_inputs,
    reference=_merge_reference,
    call=lambda subject, kw, p: ImplOutput(returned(subject.fn(**kw), ("out", "lse")), deviations=subject.deviations),
    checks=(Check("out", OUT, dtype=torch.bfloat16, bound="out_bound"),
            Check("lse", LSE, "logit_l1", dtype=torch.float32, bound="lse_bound")),
    knobs=lambda p: knobs(p, num_tokens=p.tokens, dcp_size=p.ranks),
    explain_nan=_merge_nan_inputs,
    doc="cp_lse_ag_out_rs: sanitize NaN/+inf LSEs, merge by log-sum-exp, bf16 per-rank terms, sum",
), priority=0)


# ----------------------------------------------------------------------------- multi-process DCP

MAX_RANKS = 8


def _rank_params(p: Profile, world_size: int) -> st.SearchStrategy[dict]:
    """Multi-process DCP batches for `world_size` ranks: local heads whose gathered count stays
    in their FP8 decode envelope (H * N <= 64), interleave 1 and > 1, empty shards, zero-length
    padding requests with and without context, CUDA-graph padding rows, either combine."""
    heads = [h for h in sorted({1, *p.heads, *p.mqa_heads}) if h < 32 and h * world_size <= 64]

    @st.composite
    def params(draw):
        batch = batch_params(draw, p, "fp8_ds_mla", draw(st.sampled_from(heads)), world_size, short_contexts=True)
        pad_rows = draw(st.integers(0, 3)) if batch["mqa"] == "all" else 0
        return {**batch, "combine": draw(st.sampled_from(COMBINES)), "pad_rows": pad_rows}

    return params()


def _rank_checks() -> tuple[Check, ...]:
    """What rank r received (its heads, merged) and its partial over its own shard."""
    checks = []
    for r in range(MAX_RANKS):  # ranks past the case's world size have no reference: skipped
        checks += [
            Check(f"out_rank{r}", OUT, dtype=torch.bfloat16, rank=r),
            Check(f"lse_rank{r}", LSE, f"logit_l1_rank{r}", dtype=torch.float32, rank=r),
            Check(f"partial_out_rank{r}", OUT, optional=True, single_rank=True, dtype=torch.bfloat16, rank=r),
            Check(f"partial_lse_rank{r}", LSE, f"partial_logit_l1_rank{r}", optional=True, single_rank=True,
                  dtype=torch.float32, rank=r),
        ]
    return tuple(checks)


def _dcp_reference(kw, p):
    """Rank r: heads [r*H, (r+1)*H) of the exact merge over every rank, and its own forward_mqa."""
    b, heads = kw["batch"], p.heads
    ranks = b.rank_metadata(reference.MQAMetadata)
    merged = reference.forward_mqa_dcp(b.q, b.rank_caches, b.topk_indices, ranks, exact_merge=True)
    ref = {}
    for r, (cache, metadata) in enumerate(zip(b.rank_caches, ranks)):
        mine = slice(r * heads, (r + 1) * heads)
        part = reference.forward_mqa(b.q, cache, b.topk_indices, metadata)
        ref.update({
            f"out_rank{r}": merged.out[:, mine], f"lse_rank{r}": merged.lse[:, mine],
            f"logit_l1_rank{r}": merged.logit_l1[:, mine], f"partial_out_rank{r}": part.out,
            f"partial_lse_rank{r}": part.lse, f"partial_logit_l1_rank{r}": part.logit_l1,
        })
    return ref


def _dcp_call(subject, kw, p) -> ImplOutput:
    from mla_verify.equivalence.ops import dcp_ranks  # starts processes: only when a case runs

    group = dcp_ranks.group_for(p.dcp_size, device_type(kw["device"]))
    answers = group.run(p, kw["seed"], subject.specs, subject.declared)
    tensors = {f"{name}_rank{r}": t for r, a in enumerate(answers) for name, t in a["tensors"].items()}
    first = answers[0]
    return ImplOutput(tensors, stages=first["stages"], deviations=tuple(first["deviations"]), path=p.combine,
                      notes=tuple(first["notes"]) + (f"dcp: {group.place.describe()}",))


register(PipelineSpec(
    name="dcp",
    stage=None,
    params=DcpParams,
    draw=lambda p: _rank_params(p, WORLD_SIZES[0]),
    draw_ranks=_rank_params,
    ranks=WORLD_SIZES,
    inputs=lambda p, seed, device: {"batch": make_batch(p, seed, device), "seed": seed, "device": device},
    reference=_dcp_reference,
    call=_dcp_call,
    checks=_rank_checks(),
    knobs=lambda p: knobs(p, num_tokens=sum(p.query_lens) + p.pad_rows, seq_len=max(p.seq_lens)),
    path=lambda p: p.combine,
    doc="decode context parallelism over torch.distributed: q all-gather, forward_mqa on each rank's shard, "
        "AG+RS or A2A combine; every rank's heads and partial against the reference",
    own_processes=True,
), priority=0)
