"""A forward_mqa batch, built from a Case's params and seed on the device it runs on.

The batch is what vLLM hands the backend after the cache write of this step: a paged cache per
DCP rank, the block table, `query_start_loc` (decodes first), `seq_lens` (context + query), the
MQA query and the indexer's logical top-k. How the cache is laid out:

* block 0 is the null block (unused block-table entries point at it); it and the unused tail
  slots of allocated blocks hold finite stale rows, as a real cache does;
* blocks no request owns, and the padding rows between blocks when `stride_pad` > 0, are
  poisoned (every byte 0xFF: NaN in bf16, e4m3 and fp32), so a stray read shows as NaN;
* under DCP, rank r stores token p of a sequence iff (p // I) % N == r, at local position
  (p // (N * I)) * I + p % I, in its own cache through its own block table.

The top-k rows start causal (distinct positions <= the token's own position, -1 padding at the
tail) and then get the case's invalid-index patterns. `pad_rows` appends CUDA-graph padding rows
past the last request: their query is as random as any, their top-k rows stale causal rows of
request 0's range (what an earlier step left in the indexer's buffer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from mla_verify.reference.indices import dcp_local_seq_lens, dcp_owner_and_local
from mla_verify.reference.metadata import reorder_batch_threshold, split_decodes_and_prefills
from mla_verify.reference.paged_cache import scatter_rows

from .builders import permutation
from .params import ForwardParams
from .patterns import apply_patterns, distinct_rows, prefix_candidates
from .values import pooled_rows, q_values

ROW_WIDTH = {"bfloat16": 576, "fp8_ds_mla": 656, "nvfp4_ds_mla": 352}
M = TypeVar("M")


@dataclass
class Batch:
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    rank_caches: list[torch.Tensor]
    rank_block_tables: list[torch.Tensor]
    query_start_loc: list[int]
    seq_lens: list[int]
    topk_indices: torch.Tensor
    config: dict[str, Any] = field(default_factory=dict)  # the layer's fields of forward_mqa's metadata
    kv_source: list[torch.Tensor] = field(default_factory=list)  # per request [seq_len, 576] bf16

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.rank_caches[0]

    @property
    def block_table(self) -> torch.Tensor:
        return self.rank_block_tables[0]

    def metadata(self, kind: type[M], **changes: Any) -> M:
        """forward_mqa's metadata for a run without DCP, as `kind` spells it (`reference.MQAMetadata`
        or `optimized.pipeline.MQAMetadata`: the two sides share no code, their fields agree);
        `changes` replace fields."""
        fields = dict(query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, block_table=self.block_table,
                      **self.config)
        return kind(**{**fields, **changes})

    def rank_metadata(self, kind: type[M], **changes: Any) -> list[M]:
        """Every DCP rank's metadata: its own block table, dcp_size N, dcp_rank r."""
        size = len(self.rank_block_tables)
        return [self.metadata(kind, block_table=table, dcp_size=size, dcp_rank=rank, **changes)
                for rank, table in enumerate(self.rank_block_tables)]

    def forward_kwargs(self) -> dict[str, Any]:
        """The keywords a user's whole forward_mqa is called with for a run without DCP (the
        contract's, `equivalence.contracts.ForwardMqa`, and the layer's configuration)."""
        return dict(
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, block_table=self.block_table,
            topk_indices=self.topk_indices, **self.config,
        )

    def dcp_kwargs(self) -> dict[str, Any]:
        """forward_kwargs without the block table (each rank has its own)."""
        kwargs = self.forward_kwargs()
        del kwargs["block_table"]
        return kwargs


def _poisoned_storage(num_blocks: int, block_size: int, pad: int, dtype: str, device: str) -> torch.Tensor:
    """[num_blocks, block_size + pad, W], every byte 0xFF; the cache is its [:, :block_size] view."""
    width = ROW_WIDTH[dtype]
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.uint8
    storage = torch.empty((num_blocks, block_size + pad, width), dtype=torch_dtype, device=device)
    storage.view(torch.uint8).fill_(0xFF)
    return storage


def _topk_rows(gen: torch.Generator, positions: list[int], topk: int, patterns: list[str], table_tokens: int) -> torch.Tensor:
    """Causal top-k rows for tokens at `positions`, then the invalid-index patterns.

    `beyond_seq` (logical positions past the token's own, still inside the block table: the
    backend reads whatever those slots hold) is this module's; the rest are `patterns`'.
    """
    pos = torch.tensor(positions, dtype=torch.int64, device=gen.device)
    rows = distinct_rows(gen, prefix_candidates(pos + 1), topk)
    if "beyond_seq" in patterns and len(positions):
        hit = torch.rand(rows.shape, generator=gen, device=gen.device) < 0.15
        past = pos[:, None] + 1 + torch.randint(0, 64, rows.shape, generator=gen, device=gen.device)
        rows = torch.where(hit & (past < table_tokens), past, rows)
    rest = [p for p in patterns if p != "beyond_seq"]
    rows = apply_patterns(gen, rows, rest, out_of_range=(table_tokens, table_tokens + 4 * topk))
    return rows.to(torch.int32)


def make_batch(p: ForwardParams, seed: int, device: str = "cpu") -> Batch:
    """Build the batch a forward_mqa Case describes (see the module docstring and ForwardParams)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype, bs, heads, topk, regime = p.cache_dtype, p.block_size, p.heads, p.topk, p.value_regime
    dcp, inter, scale_rule = p.dcp_size, p.interleave, p.scale_rule
    qlens, ctx, seq_lens = list(p.query_lens), list(p.context_lens), p.seq_lens
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)

    local = [[dcp_local_seq_lens(s, dcp, r, inter) for s in seq_lens] for r in range(dcp)]
    blocks_needed = [[-(-n // bs) for n in lens] for lens in local]
    width_blocks = max(max(b) for b in blocks_needed) + p.table_pad
    width_blocks = max(width_blocks, 1)
    source, packed = pooled_rows(gen, sum(seq_lens), regime, dtype, scale_rule)
    kv_source = list(source.split(seq_lens))
    packed = packed.split(seq_lens)

    caches, tables = [], []
    for r in range(dcp):
        used = sum(blocks_needed[r])
        num_blocks = 1 + used + p.spare_blocks
        ids = torch.arange(1, num_blocks, device=device)
        if p.shuffle:
            ids = ids[permutation(gen, len(ids), p.inputs)]
        table = torch.zeros((len(seq_lens), width_blocks), dtype=torch.int32, device=device)
        cursor = 0
        for i, nb in enumerate(blocks_needed[r]):
            table[i, :nb] = ids[cursor : cursor + nb].to(torch.int32)
            cursor += nb
        storage = _poisoned_storage(num_blocks, bs, p.stride_pad, dtype, device)
        slots, rows = [], []
        for i, s in enumerate(seq_lens):
            owner, loc = dcp_owner_and_local(torch.arange(s, device=device), dcp, inter)
            mine = owner == r
            slots.append(table[i].long()[loc[mine] // bs] * bs + loc[mine] % bs)
            rows.append(packed[i][mine])
        # Stale rows wherever this step writes nothing in the null block and the allocated blocks.
        allocated = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), table[table > 0].long()])
        stale = (allocated[:, None] * bs + torch.arange(bs, device=device)).flatten()
        stale = stale[~torch.isin(stale, torch.cat(slots))]
        slots.append(stale)
        rows.append(pooled_rows(gen, len(stale), "normal", dtype, scale_rule)[1])
        scatter_rows(torch.cat(rows), storage[:, :bs], torch.cat(slots))
        caches.append(storage[:, :bs])
        tables.append(table)

    positions = [c + j for c, n in zip(ctx, qlens) for j in range(n)]
    pad_rows = p.pad_rows
    if pad_rows:
        if p.mqa != "all":
            raise ValueError("pad_rows needs mqa 'all': padding rows follow the whole batch")
        stale = torch.randint(0, max(seq_lens[0], 1), (pad_rows,), generator=gen, device=gen.device)
        positions += stale.tolist()
    table_tokens = width_blocks * bs * dcp  # logical positions past this are outside every table
    topk_indices = _topk_rows(gen, positions, topk, list(p.invalid), table_tokens)

    num_tokens = qsl[-1] + pad_rows
    if p.mqa == "decodes":
        threshold = reorder_batch_threshold(
            heads, p.arch, max_decode_query_len=p.max_decode_query_len,
            dcp_size=dcp, interleave=inter,
        )
        num_tokens = split_decodes_and_prefills(qsl, threshold).num_decode_tokens
    q = q_values(gen, (num_tokens, heads * dcp, 576), regime, p.inputs)
    if p.q_form == "tuple":
        q = (q[..., :512], q[..., 512:])
    config = dict(
        num_heads=heads,
        kv_cache_dtype=dtype,
        sm_scale=p.sm_scale,
        max_model_len=p.max_model_len or max(seq_lens + [1]),
        arch=p.arch,
        workspace_size=p.workspace_size,
        max_decode_query_len=p.max_decode_query_len,
    )
    if dcp > 1:
        config["interleave"] = inter
    return Batch(q, caches, tables, qsl, seq_lens, topk_indices, config, kv_source)
