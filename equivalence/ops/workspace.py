"""Gather + up-convert ops (exact): a chunk's fp8_ds_mla / nvfp4_ds_mla rows into the BF16 workspace."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from mla_verify import reference
from mla_verify.equivalence.judge.policy import EXACT
from mla_verify.equivalence.cases.values import pooled_rows
from mla_verify.reference.paged_cache import scatter_rows

from ..cases.draws import regimes, scale_rules
from ..cases.layouts import LAYOUTS, drawn, relayout
from ..cases.params import REGIME, SCALE_RULE
from ..cases.profiles import Profile
from ..cases.schema import BLOCK, PAD, Flag, Int, Ints, OneOf, Params, blocks, param
from ..spec import register
from .base import Check, ImplOutput, OpSpec
from .common import generator, knobs

WIDTH = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}


@dataclass(frozen=True)
class GatherParams(Params):
    """A prefill chunk of requests with seq_lens, in a paged cache of block_size slots per block."""

    seq_lens: tuple[int, ...] = param(Ints(0, 2**22, 4096))  # 0: an empty request slot (its start repeated)
    block_size: int = param(BLOCK)
    value_regime: str = param(REGIME)
    scale_rule: str = param(SCALE_RULE)
    stride_pad: int = param(PAD, 0)
    table_pad: int = param(Int(0, 64), 0)     # block-table columns past the longest request
    shuffle: bool = param(Flag(), True)       # blocks in random order
    layout: str = param(OneOf(*LAYOUTS), "contiguous")  # of block_table and workspace_starts (equivalence.cases.layouts)

    def elements(self) -> int:
        return (blocks(self.seq_lens, self.block_size) * (self.block_size + self.stride_pad) * 656
                + sum(self.seq_lens) * 576)

    def problem(self) -> str | None:
        return None if sum(self.seq_lens) > 0 else "a chunk needs a request of one row or more (seq_lens all 0)"


def _params(p: Profile) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({
        # 0: an empty request slot, its start repeated (vLLM pads request slots, #51486)
        "seq_lens": st.lists(st.integers(0, p.max_context), min_size=1, max_size=p.max_requests).filter(sum),
        "block_size": st.sampled_from((16,) + p.block_sizes), "stride_pad": st.sampled_from((0, 2)),
        "table_pad": st.integers(0, 2), "shuffle": st.booleans(), "value_regime": regimes, "scale_rule": scale_rules,
        "layout": st.sampled_from(drawn("gather_upconvert_fp8"))})


def _gather_inputs(fmt: str, op: str):
    def inputs(p: GatherParams, seed: int, device: str) -> dict:
        g = generator(seed, device)
        bs, seq_lens = p.block_size, p.seq_lens
        pages = [-(-n // bs) for n in seq_lens]
        num_blocks = sum(pages) + 1
        order = torch.randperm(num_blocks, generator=g, device=device) if p.shuffle else torch.arange(num_blocks, device=device)
        table = torch.zeros((len(seq_lens), max(pages) + p.table_pad), dtype=torch.int64, device=device)
        storage = torch.full((num_blocks, bs + p.stride_pad, WIDTH[fmt]), 0xFF, dtype=torch.uint8, device=device)
        slots, cursor = [], 0
        for r, (n, nb) in enumerate(zip(seq_lens, pages)):
            table[r, :nb] = order[cursor : cursor + nb]
            cursor += nb
            pos = torch.arange(n, device=device)
            slots.append(table[r][pos // bs] * bs + pos % bs)  # only the sequences' rows: the rest stays NaN
        slots = torch.cat(slots)
        scatter_rows(pooled_rows(g, len(slots), p.value_regime, fmt, p.scale_rule)[1], storage[:, :bs], slots)
        starts = torch.tensor([0, *seq_lens[:-1]], device=device).cumsum(0)
        return relayout(op, {
            "kv_cache": storage[:, :bs], "block_table": table.to(torch.int32), "workspace_starts": starts.to(torch.int32),
            "num_rows": sum(seq_lens)}, p.layout)

    return inputs


for _fmt, _fn in (("fp8_ds_mla", reference.gather_upconvert_fp8), ("nvfp4_ds_mla", reference.gather_upconvert_nvfp4)):
    _name = "gather_upconvert_fp8" if _fmt == "fp8_ds_mla" else "gather_upconvert_nvfp4"
    register(OpSpec(
        name=_name,
        stage=_name,
        params=GatherParams,
        draw=_params,
        inputs=_gather_inputs(_fmt, _name),
        reference=lambda kw, p, fn=_fn: {"workspace": fn(**kw)},
        call=lambda subject, kw, p: ImplOutput({"workspace": subject.fn(**kw)}, deviations=subject.deviations),
        checks=(Check("workspace", EXACT, contiguous=True),),
        knobs=lambda p, fmt=_fmt: knobs(p, num_tokens=sum(p.seq_lens), seq_len=max(p.seq_lens), cache_dtype=fmt),
        doc=f"cp_gather_and_upconvert ({_fmt}): rows of a prefill chunk into the bf16 workspace, bits exact",
    ), priority=0)
