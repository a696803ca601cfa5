"""The V4 decode step as a pipeline (`optimized.v4_pipeline`): window_indices, then
sparse_decode_v4, against `reference.v4_decode`. A failing case is run again stage by stage
(`ops.stages`) and names the first stage whose output differs on its own inputs.

Its cases are the union decode's (`ops.v4`), V4 caches, except the main list: the window (V4's
128 tokens: `topk` is 128) cache is paged through a block table, each request's window positions
in blocks of their own (shuffled), every other logical block mapped to one poisoned block; the
window's lengths are the step's own.
"""

from __future__ import annotations

import torch

from mla_verify import reference
from mla_verify.reference.v4_forward import WINDOW
from mla_verify.equivalence.judge.policy import LSE, OUT
from mla_verify.equivalence.sandbox.call_guards import guarded
from mla_verify.optimized import registry

from ..spec import op_of, register
from .base import Check, ImplOutput
from .common import generator, host_values
from .pipeline import PipelineSpec
from .stages import recorded
from .v4 import UnionDecodeParams, elem_bounds, latent_rows, union_decode_inputs, union_decode_params


def _window_cache(g, p: UnionDecodeParams, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the window's cache, the block table): request b's blocks holding positions
    pos_b - S - WINDOW + 2 .. pos_b are distinct physical blocks (shuffled, from 1), every other
    logical block is block 0, never written (all 0xFF)."""
    bs, window = p.block_size, WINDOW
    first = [max(0, pos - p.s_q - window + 2) // bs for pos in p.positions]
    last = [pos // bs for pos in p.positions]
    live = sum(b - a + 1 for a, b in zip(first, last))
    physical = (torch.randperm(live, generator=g, device=device) + 1).tolist()
    table = torch.zeros((p.batch, max(last) + 1), dtype=torch.int32)
    for b, (a, z) in enumerate(zip(first, last)):
        table[b, a:z + 1] = torch.tensor(physical[:z - a + 1], dtype=torch.int32)
        physical = physical[z - a + 1:]
    cache = reference.allocate_cache(live + 1, bs, "V4", device=device)
    written = table.flatten()[table.flatten() > 0].long().to(device)
    slots = (written[:, None] * bs + torch.arange(bs, device=device)).flatten()
    reference.write_v4_cache(latent_rows(g, slots.numel(), p), cache, slots, p.scale_rule)
    return cache, table.to(device)


def _inputs(p: UnionDecodeParams, seed: int, device: str) -> dict:
    kw = union_decode_inputs(p, seed, device)
    cache, table = _window_cache(generator(seed + 1, device), p, device)
    return {"q": kw["q"], "kv_cache": cache, "positions": host_values(list(p.positions), device).to(torch.int32),
            "block_table": table, "sm_scale": p.sm_scale, "extra_kv_cache": kw["extra_kv_cache"],
            "extra_indices": kw["extra_indices"], "extra_topk_length": kw["extra_topk_length"],
            "attn_sink": kw["attn_sink"]}


def _reference(kw: dict, p: UnionDecodeParams) -> dict:
    extra = None if kw["extra_kv_cache"] is None else reference.Paged(kw["extra_kv_cache"], kw["extra_indices"],
                                                                       kw["extra_topk_length"])
    res = reference.v4_decode(kw["q"], kw["kv_cache"], kw["positions"], kw["block_table"], kw["sm_scale"], extra,
                              kw["attn_sink"], magnitudes=True)
    width = WINDOW + p.extra_topk
    found = elem_bounds(res, width, p, lse_of=lambda x: x.transpose(1, 2), sink=kw["attn_sink"])
    return {"out": res.out, "lse": res.lse, "logit_l1": res.logit_l1,
            **{key: t for key, t in found.items() if key.name != "max_logits_bound"}}


def _call(subject, kw: dict, p: UnionDecodeParams) -> ImplOutput:
    if subject.fn is not None:  # a user's whole decode step
        out, lse = subject.fn(**kw)[:2]
        return ImplOutput({"out": out, "lse": lse}, deviations=subject.deviations)
    from mla_verify.optimized import v4_pipeline  # the kernels: only when the pipeline runs

    stages = recorded(guarded(registry.resolve(v4_pipeline.STAGES, kw["q"].device.type, subject.overrides), op_of))
    out, lse = v4_pipeline.v4_step(stages)(**kw)
    deviations = tuple(sorted({d for impl in stages.chosen.values() for d in impl.deviations}))
    notes = tuple(f"{stage}: {why}" for stage, why in sorted(stages.fallbacks.items()))
    return ImplOutput({"out": out, "lse": lse}, stages=stages.pairs(), deviations=deviations, notes=notes)


V4_DECODE = register(PipelineSpec(
    name="v4_decode", stage=None, params=UnionDecodeParams,
    draw=lambda prof: union_decode_params(prof, "V4", ("V4",)).map(lambda d: {**d, "topk": WINDOW, "lengths": "exact"}),
    inputs=_inputs, reference=_reference, call=_call,
    checks=(Check("out", OUT, dtype=torch.bfloat16, bound="out_bound"),
            Check("lse", LSE, "logit_l1", dtype=torch.float32, bound="lse_bound")),
    knobs=lambda p: {"topk": p.topk + p.extra_topk, "heads": p.heads, "block_size": p.block_size,
                     "num_tokens": p.batch * p.s_q, "seq_len": max(p.positions) + 1, "cache_dtype": "V4",
                     "scale_rule": p.scale_rule, "value_regime": p.value_regime, "sm_scale": p.sm_scale},
    variants={"pipeline": (), "pipeline[triton attention]": ("sparse_decode_v4=triton",)},
    doc="a DeepSeek V4 decode step: window_indices from positions and the block table, then sparse_decode_v4",
), priority=0)
