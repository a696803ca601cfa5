"""fp8_ds_mla cache bytes: quantize, dequantize, and the paged cache writer (all exact)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from mla_verify import reference
from mla_verify.equivalence.judge.policy import EXACT
from mla_verify.equivalence.cases.values import kv_values

from ..cases.draws import regimes, scale_rules
from ..cases.layouts import LAYOUTS, drawn, relayout
from ..cases.params import REGIME, SCALE_RULE
from ..cases.profiles import Profile
from ..cases.schema import BLOCK, Int, OneOf, PAD, Params, Real, param
from ..spec import register
from .base import Check, ImplOutput, OpSpec
from .common import generator, knobs, rand, single


@dataclass(frozen=True)
class CodecParams(Params):
    """n rows of 576 bf16 values through the fp8_ds_mla row codec."""

    n: int = param(Int(1, 2**22))
    value_regime: str = param(REGIME)
    scale_rule: str = param(SCALE_RULE)
    layout: str = param(OneOf(*LAYOUTS), "contiguous")  # of the input rows (equivalence.cases.layouts)

    def elements(self) -> int:
        return self.n * 1232


def _codec_params(p: Profile) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({"n": st.integers(1, 4 * p.max_tokens), "value_regime": regimes,
                                  "scale_rule": scale_rules, "layout": st.sampled_from(drawn("quantize_fp8_ds_mla"))})


def _kv(p: CodecParams, seed: int, device: str) -> torch.Tensor:
    return kv_values(generator(seed, device), p.n, p.value_regime)


register(OpSpec(
    name="quantize_fp8_ds_mla",
    stage="quantize_fp8_ds_mla",
    params=CodecParams,
    draw=_codec_params,
    inputs=lambda p, seed, device: relayout("quantize_fp8_ds_mla", {"kv": _kv(p, seed, device), "scale_rule": p.scale_rule},
                                            p.layout),
    reference=lambda kw, p: {"rows": reference.quantize_fp8_ds_mla(kw["kv"], kw["scale_rule"])},
    call=single(lambda rows: {"rows": rows}),
    checks=(Check("rows", EXACT),),
    knobs=lambda p: knobs(p, num_tokens=p.n),
    doc="[N,576] bf16 -> [N,656] uint8 rows; bytes must match exactly",
), priority=0)

register(OpSpec(
    name="dequantize_fp8_ds_mla",
    stage="dequantize_fp8_ds_mla",
    params=CodecParams,
    draw=_codec_params,
    inputs=lambda p, seed, device: relayout(
        "dequantize_fp8_ds_mla", {"rows": reference.quantize_fp8_ds_mla(_kv(p, seed, device), p.scale_rule)}, p.layout),
    reference=lambda kw, p: {"values": reference.dequantize_fp8_ds_mla(kw["rows"])},
    call=single(lambda values: {"values": values}),
    checks=(Check("values", EXACT),),
    knobs=lambda p: knobs(p, num_tokens=p.n),
    doc="[N,656] uint8 -> [N,576] bf16 = bf16(fp32(fp8) * scale); bits must match",
), priority=0)


def _writer_params(p: Profile) -> st.SearchStrategy[dict]:
    @st.composite
    def params(draw):
        block_size = draw(st.sampled_from((16,) + p.block_sizes))
        num_blocks = draw(st.integers(1, 4))
        return {"n": draw(st.integers(1, num_blocks * block_size)), "num_blocks": num_blocks, "block_size": block_size,
                "stride_pad": draw(st.sampled_from((0, 1, 3))), "value_regime": draw(regimes),
                "scale_rule": draw(scale_rules), "skip_frac": draw(st.sampled_from((0.0, 0.2))),
                "layout": draw(st.sampled_from(drawn("write_fp8_ds_mla_cache")))}

    return params()


@dataclass(frozen=True)
class WriterParams(Params):
    """n rows written into a paged cache of num_blocks blocks, some slots skipped (-1)."""

    n: int = param(Int(1, 2**22))
    num_blocks: int = param(Int(1, 2**20))
    block_size: int = param(BLOCK)
    value_regime: str = param(REGIME)
    scale_rule: str = param(SCALE_RULE)
    stride_pad: int = param(PAD, 0)      # slots between blocks past the block size (poisoned)
    skip_frac: float = param(Real(0, 1), 0.0)
    layout: str = param(OneOf(*LAYOUTS), "contiguous")  # of kv and slot_mapping (equivalence.cases.layouts)

    def elements(self) -> int:
        return self.num_blocks * (self.block_size + self.stride_pad) * 1312 + self.n * 577

    def problem(self) -> str | None:
        return None if self.n <= self.num_blocks * self.block_size else "n exceeds num_blocks * block_size slots"


def _writer_inputs(p: WriterParams, seed: int, device: str) -> dict:
    g = generator(seed, device)
    kv = kv_values(g, p.n, p.value_regime)
    slots = torch.randperm(p.num_blocks * p.block_size, generator=g, device=device)[: p.n]
    slots[rand(g, p.n) < p.skip_frac] = -1
    # Every byte the writer must leave alone (skipped slots, padding rows) is poisoned.
    storage = torch.full((p.num_blocks, p.block_size + p.stride_pad, 656), 0xFF, dtype=torch.uint8, device=device)
    return relayout("write_fp8_ds_mla_cache", {"kv": kv, "kv_cache": storage[:, : p.block_size], "slot_mapping": slots,
                                               "scale_rule": p.scale_rule}, p.layout)


def _fresh_cache(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A new all-0xFF storage with `like`'s geometry (padding rows included) and its cache view."""
    num_blocks, block_size, width = like.shape
    storage = torch.full((num_blocks, like.stride(0) // width, width), 0xFF, dtype=torch.uint8, device=like.device)
    return storage, storage[:, :block_size]


def _reference_write(kw, p):
    storage, cache = _fresh_cache(kw["kv_cache"])
    reference.write_fp8_ds_mla_cache(kw["kv"], cache, kw["slot_mapping"], kw["scale_rule"])
    return {"cache": storage}


def _call_write(subject, kw, p):
    storage, cache = _fresh_cache(kw["kv_cache"])
    subject.fn(kv=kw["kv"], kv_cache=cache, slot_mapping=kw["slot_mapping"], scale_rule=kw["scale_rule"])
    return ImplOutput({"cache": storage}, deviations=subject.deviations)


WRITE_CACHE = register(OpSpec(
    name="write_fp8_ds_mla_cache",
    stage="write_fp8_ds_mla_cache",
    params=WriterParams,
    draw=_writer_params,
    inputs=_writer_inputs,
    reference=_reference_write,
    call=_call_write,
    checks=(Check("cache", EXACT),),
    writes=("kv_cache",),
    knobs=lambda p: knobs(p, num_tokens=p.n),
    doc="quantize + scatter by slot mapping into a paged cache; every byte of the cache's storage "
        "(including padding rows between blocks and skipped slots) must match",
), priority=0)
