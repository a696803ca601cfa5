"""DeepSeek V4 / V4.1 cache writers: rows quantized into a paged cache by slot mapping, every byte
of the cache's storage compared (exact). The rows carry the codecs' edge tiles: all-zero tiles
(the scale floors), tiles of -0, a NaN or an infinity in a tile (its scale NaN), bf16 subnormals,
and tiles at powers of two apart."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from mla_verify import reference
from mla_verify.equivalence.judge.policy import EXACT
from mla_verify.equivalence.cases.values import kv_values

from ..cases.draws import regimes
from ..cases.params import REGIME
from ..cases.profiles import Profile
from ..cases.schema import BLOCK, Flag, Int, OneOf, Params, Real, param
from ..spec import register
from .base import Check, ImplOutput, OpSpec
from .common import generator, knobs, rand, randint
from .v4 import SCALE_RULES, WIDTH


@dataclass(frozen=True)
class V4WriterParams(Params):
    """n rows written into a cache of num_blocks blocks in `kv_format`, some slots skipped (-1)."""

    n: int = param(Int(1, 2**22))
    num_blocks: int = param(Int(1, 2**20))
    block_size: int = param(BLOCK)
    kv_format: str = param(OneOf("V4", "V41", "V41_FP4"))
    value_regime: str = param(REGIME)
    scale_rule: str = param(OneOf(*SCALE_RULES))
    special_tiles: bool = param(Flag(), False)   # zero, -0, NaN, inf and subnormal tiles in some rows
    page_gap: int = param(Int(0, 64), 0)         # 16-byte units between blocks past the allocation (poisoned)
    skip_frac: float = param(Real(0, 1), 0.0)

    def elements(self) -> int:
        return self.num_blocks * (self.block_size * WIDTH[self.kv_format] + 16 * self.page_gap + 576) + self.n * 513

    def problem(self) -> str | None:
        return None if self.n <= self.num_blocks * self.block_size else "n exceeds num_blocks * block_size slots"


def _writer_params(p: Profile, formats: tuple[str, ...]) -> st.SearchStrategy[dict]:
    @st.composite
    def params(draw):
        block_size = draw(st.sampled_from((1, 5, 61) + p.block_sizes))
        num_blocks = draw(st.integers(1, 4))
        return {"n": draw(st.integers(1, num_blocks * block_size)), "num_blocks": num_blocks, "block_size": block_size,
                "kv_format": draw(st.sampled_from(formats)), "value_regime": draw(regimes),
                "scale_rule": draw(st.sampled_from(SCALE_RULES)), "special_tiles": draw(st.booleans()),
                "page_gap": draw(st.sampled_from((0, 1))), "skip_frac": draw(st.sampled_from((0.0, 0.2)))}

    return params()


def edge_rows(g: torch.Generator, n: int, regime: str, special: bool) -> torch.Tensor:
    """[n, 512] bf16 rows in `regime`, 16-dim tiles powers of two apart; with `special`, rows 0-4
    carry a zero tile, a -0 tile, a NaN, an infinity and bf16 subnormals (as many as fit)."""
    x = kv_values(g, n, regime)[:, :512].float()
    power = randint(g, -6, 7, n, 32).float()
    x = (x.view(n, 32, 16) * torch.exp2(power)[..., None]).view(n, 512)
    if special:
        edits = [(slice(0, 64), 0.0), (slice(64, 128), -0.0), (slice(200, 201), float("nan")),
                 (slice(300, 301), float("-inf")), (slice(0, 512), 2.0**-133)]
        for row, (dims, value) in zip(range(n), edits):
            x[row, dims] = value
    return x.to(torch.bfloat16)


def _cache_storage(p: V4WriterParams, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An all-0xFF storage (gaps included) and its [NB, BS, W] cache view."""
    width = WIDTH[p.kv_format]
    stride = reference.allocate_cache(1, p.block_size, p.kv_format).stride(0) + 16 * p.page_gap
    storage = torch.full((p.num_blocks * stride,), 0xFF, dtype=torch.uint8, device=device)
    return storage, storage.as_strided((p.num_blocks, p.block_size, width), (stride, width, 1))


def _writer_inputs(p: V4WriterParams, seed: int, device: str) -> dict:
    g = generator(seed, device)
    slots = torch.randperm(p.num_blocks * p.block_size, generator=g, device=device)[: p.n]
    slots[rand(g, p.n) < p.skip_frac] = -1
    _, cache = _cache_storage(p, device)
    return {"kv": edge_rows(g, p.n, p.value_regime, p.special_tiles), "kv_cache": cache, "slot_mapping": slots,
            "scale_rule": p.scale_rule}


def _reference_write(kw, p):
    storage, cache = _cache_storage(p, kw["kv"].device.type)
    reference.write_v4_cache(kw["kv"], cache, kw["slot_mapping"], kw["scale_rule"], kv_format=p.kv_format)
    return {"cache": storage}


def _call_write(subject, kw, p):
    storage, cache = _cache_storage(p, kw["kv"].device.type)
    subject.fn(kv=kw["kv"], kv_cache=cache, slot_mapping=kw["slot_mapping"], scale_rule=kw["scale_rule"])
    return ImplOutput({"cache": storage}, deviations=subject.deviations)


def _spec(name: str, formats: tuple[str, ...], doc: str) -> OpSpec:
    return OpSpec(name=name, stage=name, params=V4WriterParams, draw=lambda p: _writer_params(p, formats),
                  inputs=_writer_inputs, reference=_reference_write, call=_call_write, checks=(Check("cache", EXACT),),
                  writes=("kv_cache",), knobs=lambda p: knobs(p, num_tokens=p.n, cache_dtype=p.kv_format), doc=doc)


register(_spec("write_v4_cache", ("V4",),
               "V4 rows (448 e4m3 in ue8m0 tiles of 64 + 64 bf16 RoPE) into block-major 584-byte pages; every byte "
               "of the storage must match"), priority=0)
register(_spec("write_v41_cache", ("V41", "V41_FP4"),
               "V4.1 rows (512 e4m3, ue8m0 tiles of 32) or V4.1 FP4 rows (e2m1, e4m3 tiles of 16) into per-token "
               "pages; every byte of the storage must match"), priority=0)
