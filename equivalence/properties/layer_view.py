"""layer_view: a cache handed as one layer's view of a multi-layer allocation reads and writes as
the same cache alone (vLLM's cross-layer layout [blocks, layers, block_size, W]; HiSparse's
layer-offset bug class).

    read    forward_mqa on the batch's cache and on the same bytes as layer `layer` of LAYERS
            layers (stride(0) LAYERS times the block's, a nonzero storage offset past layer 0):
            every output bit for bit the same; the neighbouring layers hold poison
    write   write_fp8_ds_mla_cache into such a layer view: the layer's bytes as a write into the
            cache alone, every byte of the neighbouring layers untouched
"""

from __future__ import annotations

import dataclasses

import torch

from mla_verify.equivalence.cases.batch import make_batch
from mla_verify.equivalence.judge.policy import EXACT, LSE, OUT

from ..cases.draws import forward_params
from ..ops.formats import WRITE_CACHE
from ..spec import register
from ..sandbox.produced import Compared
from .base import PropertySpec, Target
from .common import PIPELINE_STAGES, forward, forward_knobs, forward_stages

LAYERS = 3
LAYER = 1  # the middle one: neighbours on both sides


def layer_view(cache: torch.Tensor, fill: int = 0xFF) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole allocation [NB, LAYERS, rows, W], `cache`'s bytes as layer LAYER of it); `cache`
    is [NB, BS, W] with its padding rows (stride(0) // stride(1) rows a block), every other layer
    filled with `fill` bytes."""
    blocks, bs, width = cache.shape
    rows = cache.stride(0) // cache.stride(1)
    whole = torch.empty((blocks, LAYERS, rows, width), dtype=cache.dtype, device=cache.device)
    whole.view(torch.uint8).fill_(fill)
    dense = torch.as_strided(cache, (blocks, rows, width), (cache.stride(0), cache.stride(1), 1))
    whole[:, LAYER] = dense
    return whole, whole[:, LAYER, :bs]


def _read(kw: dict, p, stages) -> list[Compared]:
    batch = kw["batch"]
    views = [layer_view(cache)[1] for cache in batch.rank_caches]  # under DCP each rank's cache
    alone = forward(stages, batch)
    viewed = forward(stages, dataclasses.replace(batch, rank_caches=views))
    return [Compared("read", "out", OUT, viewed[0], alone[0]), Compared("read", "lse", LSE, viewed[1], alone[1])]


def _write(kw: dict, p, stages) -> list[Compared]:
    write = stages.fn("write_fp8_ds_mla_cache")
    alone = kw["kv_cache"].clone()
    write(kv=kw["kv"], kv_cache=alone, slot_mapping=kw["slot_mapping"], scale_rule=kw["scale_rule"])
    whole, view = layer_view(kw["kv_cache"])
    before = whole.clone()
    write(kv=kw["kv"], kv_cache=view, slot_mapping=kw["slot_mapping"], scale_rule=kw["scale_rule"])
    others = [i for i in range(LAYERS) if i != LAYER]
    return [Compared("write", "layer", EXACT, view.contiguous(), alone.contiguous()),
            Compared("write", "neighbours", EXACT, whole[:, others].contiguous(), before[:, others].contiguous())]


register(PropertySpec(
    short="layer_view",
    checks=("read", "write"),
    targets={
        "forward_mqa": Target("forward_mqa", forward_stages, PIPELINE_STAGES,
                              lambda p, seed, device: {"batch": make_batch(p, seed, device)}, _read, forward_knobs,
                              lambda prof: forward_params(prof), runs=lambda p: 2),
        "write_fp8_ds_mla_cache": Target("write_fp8_ds_mla_cache", lambda p: ["write_fp8_ds_mla_cache"],
                                         ("write_fp8_ds_mla_cache",), WRITE_CACHE.inputs, _write, WRITE_CACHE.knobs,
                                         WRITE_CACHE.draw, runs=lambda p: 0),
    },
    doc="a cache as one layer's view of a multi-layer allocation: bitwise the same outputs; writers leave the "
        "neighbouring layers' bytes untouched",
), priority=109)
