"""forward_mqa end to end: the project's pipeline (or a user's stage / whole replacement) against
the reference's, on batches from `equivalence.cases.batch`; under DCP every rank runs and the partials
are merged, against the reference's exact merge."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from mla_verify import reference
from mla_verify.equivalence.cases.batch import make_batch
from mla_verify.equivalence.sandbox.call_guards import guarded
from mla_verify.equivalence.sandbox.guards import owned
from mla_verify.equivalence.cases.hisparse_batch import make_hisparse_batch
from mla_verify.equivalence.judge.policy import LSE, OUT
from mla_verify.optimized import registry
from mla_verify.optimized.validation import InputError

from ..cases.draws import FORWARD_PATHS, HISPARSE_PATHS, forward_params, hisparse_params
from ..cases.params import ForwardParams
from ..cases.profiles import Profile
from ..spec import op_of, register
from .base import Check, ImplOutput
from .common import knobs
from .pipeline import PipelineSpec
from .stages import recorded


def path_stages(path: str) -> frozenset[str]:
    """The stages a path's batches may call (`optimized.pipeline.needed_stages` of its cache and
    heads: q as (ql_nope, q_pe) where the draws may hand it so, every DCP rank count; HiSparse's own)."""
    from mla_verify.optimized import hisparse, pipeline  # imports every kernel module: only when asked

    if path in HISPARSE_PATHS:
        return frozenset(hisparse.needed_stages("bfloat16" if path == "bf16_hisparse" else "fp8_ds_mla"))
    cache = "bfloat16" if path == "bf16" else "fp8_ds_mla"
    heads, dcp = (32, 1) if path == "fp8_separate" else (16, 2 if path == "fp8_mixed_dcp" else 1)
    return frozenset(pipeline.needed_stages(cache, heads, dcp, q_is_tuple=dcp == 1))


def _path_params(p: Profile, path: str) -> st.SearchStrategy[dict]:
    return hisparse_params(p, path) if path in HISPARSE_PATHS else forward_params(p, path)


def path_of(p: ForwardParams) -> str:
    if p.hisparse:
        return "bf16_hisparse" if p.cache_dtype == "bfloat16" else "fp8_separate_hisparse"
    path = reference.select_path(p.cache_dtype, p.heads)
    return path + "_dcp" if p.dcp_size > 1 else path


def _layers(outs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every layer of a HiSparse group compared: the layers' rows concatenated along the tokens."""
    return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}


def _inputs(p: ForwardParams, seed: int, device: str) -> dict:
    return {"batch": make_hisparse_batch(p, seed, device) if p.hisparse else make_batch(p, seed, device)}


def _reference(kw, p: ForwardParams):
    b = kw["batch"]
    if p.hisparse:
        res = reference.forward_mqa_hisparse(b.q_layers, b.host_caches, b.gpu_rows, b.plain.topk_indices,
                                             b.plain.metadata(reference.MQAMetadata),
                                             b.hisparse_tables(reference.HiSparseTables))
        return _layers([{"out": r.out, "lse": r.lse, "logit_l1": r.logit_l1} for r in res])
    if p.dcp_size > 1:
        res = reference.forward_mqa_dcp(b.q, b.rank_caches, b.topk_indices, b.rank_metadata(reference.MQAMetadata),
                                        exact_merge=True)
    else:
        res = reference.forward_mqa(b.q, b.kv_cache, b.topk_indices, b.metadata(reference.MQAMetadata))
    return {"out": res.out, "lse": res.lse, "logit_l1": res.logit_l1}


def _whole(fn, b, p: ForwardParams, deviations: tuple[str, ...]) -> ImplOutput:
    """A user's complete forward_mqa (with its declared deviations); under DCP it runs per rank and
    the registry's merge combines."""
    if p.dcp_size == 1:
        out, lse = fn(q=b.q, kv_cache=b.kv_cache, **b.forward_kwargs())[:2]
        return ImplOutput({"out": out, "lse": lse}, deviations=deviations)
    kwargs, size = b.dcp_kwargs(), p.dcp_size
    # each rank's answer owned before the next rank's call (a serving kernel returns its static buffer)
    parts = [owned(fn(q=b.q, kv_cache=c, block_table=t, dcp_size=size, dcp_rank=r, **kwargs)[:2])
             for r, (c, t) in enumerate(zip(b.rank_caches, b.rank_block_tables))]
    merge = registry.select("dcp_merge", b.kv_cache.device.type)
    out, lse = merge.fn(outs=torch.stack([o for o, _ in parts]), lses=torch.stack([s for _, s in parts]))
    return ImplOutput({"out": out, "lse": lse}, stages=(("dcp_merge", merge.name),),
                      deviations=tuple(sorted({*deviations, *merge.deviations})))


def _call(subject, kw, p: ForwardParams) -> ImplOutput:
    b = kw["batch"]
    if p.hisparse:
        return _hisparse(subject, b, p)
    if subject.fn is not None:
        return _whole(subject.fn, b, p, subject.deviations)
    from mla_verify.optimized import pipeline  # imports every kernel module: only when the pipeline runs
    dcp = p.dcp_size
    needed = pipeline.needed_stages(p.cache_dtype, p.heads, dcp, isinstance(b.q, tuple))
    stages = recorded(guarded(registry.resolve(needed, b.kv_cache.device.type, subject.overrides), op_of))
    if dcp > 1:
        ranks = b.rank_metadata(pipeline.MQAMetadata)
        res = pipeline.forward_mqa_dcp(b.q, b.rank_caches, b.topk_indices, ranks, stages)
    else:
        res = pipeline.forward_mqa(b.q, b.kv_cache, b.topk_indices, b.metadata(pipeline.MQAMetadata), stages)
    deviations = tuple(sorted({d for impl in stages.chosen.values() for d in impl.deviations}))
    notes = tuple(f"{stage}: {why}" for stage, why in sorted(stages.fallbacks.items()))
    return ImplOutput({"out": res.out, "lse": res.lse}, stages=stages.pairs(), deviations=deviations,
                      path=res.path, notes=notes)


def _hisparse(subject, b, p: ForwardParams) -> ImplOutput:
    """The HiSparse pipeline over every layer of the group, stages resolved as the plain paths'."""
    if subject.fn is not None:
        raise InputError("the HiSparse paths take stage implementations (--impl NAME or STAGE=...), not a whole forward_mqa")
    from mla_verify.optimized import hisparse, pipeline

    device = b.gpu_rows[0].device.type
    stages = guarded(registry.resolve(hisparse.needed_stages(p.cache_dtype), device, subject.overrides), op_of)
    tables = b.hisparse_tables(hisparse.HiSparseTables)
    res = hisparse.forward_mqa_hisparse(b.q_layers, b.host_caches, b.gpu_rows, b.plain.topk_indices,
                                        b.plain.metadata(pipeline.MQAMetadata), tables, b.group_buffer, stages)
    deviations = tuple(sorted({d for impl in stages.chosen.values() for d in impl.deviations}))
    notes = tuple(f"{stage}: {why}" for stage, why in sorted(stages.fallbacks.items()))
    return ImplOutput(_layers([{"out": r.out, "lse": r.lse} for r in res]), stages=stages.pairs(),
                      deviations=deviations, path=res[0].path, notes=notes)


FORWARD_MQA = register(PipelineSpec(
    name="forward_mqa",
    stage=None,
    params=ForwardParams,
    draw=forward_params,
    inputs=_inputs,
    reference=_reference,
    call=_call,
    checks=(Check("out", OUT, dtype=torch.bfloat16), Check("lse", LSE, "logit_l1", dtype=torch.float32)),
    knobs=lambda p: knobs(p, num_tokens=sum(p.query_lens), seq_len=max(p.seq_lens)),
    path=path_of,
    paths=FORWARD_PATHS,
    own_campaigns=HISPARSE_PATHS,
    draw_path=_path_params,
    traced=lambda p: not p.hisparse,  # the HiSparse pipeline's stages have no stage oracle here
    path_stages=path_stages,
    doc="FlashMLASparseImpl.forward_mqa: bf16 / fp8_mixed / fp8_separate paths, with DCP over ranks, and the HiSparse paths",
), priority=0)
