"""HiSparse (host-backed KV) `forward_mqa`, composed from registry stages (spec hisparse.md §2-4).

Tiers: per layer a host cache [HB, B, W] (pinned CPU memory on CUDA) addressed by the batch's
block table, and a device slab of flat rows (GPU block g, offset o = row g * S + o) holding the
resident pages (`residency`, by state row through `request_state_indices`) and each request's
hot slots (`hot_block_table`). Stages, each replaceable:

  convert_index          host rows, resident rows, resident path, staged rows, workspace rows
  hisparse_place         the residency resolve: resident hit / hot hit / miss -> LRU slot; the swap list
  hisparse_swap_in       copy the swap list's host rows into the slab (hisparse_gather_compact)
  hisparse_prefill_plan  the staging plan: compact block table, host and device source rows
  stage_prefill_rows     the staged cache of the prefills' rows; req ids rebased by num_decodes
  gather_fp8_prefill     a chunk's workspace from the staged rows (plan rows [request_start, +batch))
  index_group            convert once per group (persistent buffers, fallback), swap once per group
  sparse_prefill / sparse_decode_fp8 / spec-decode reshapes / split_prefill_chunks: as the plain paths

Routing and branches are the reference's (`reference.hisparse`). Our FP8 prefill stages the rows
and then gathers them (upstream gathers from host and device rows in one kernel): same rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from . import buffers, eager
from .index_group import IndexGroup, SwapIn
from .kernels import gather as triton_gather
from .metadata import (
    BatchSplit,
    PrefillChunk,
    active_decodes,
    plan_prefill,
    prefill_workspace_size,
    req_id_per_token,
    split_decodes_and_prefills,
)
from .pipeline import V_DIM, MQAMetadata, PipelineResult
from .registry import EAGER, TRITON, Resolved, register, resolve
from .validation import InputError

BF16_STAGES = ["index_group", "convert_index", "hisparse_place", "hisparse_swap_in", "hisparse_prefill_plan",
               "stage_prefill_rows", "sparse_prefill"]
FP8_STAGES = ["index_group", "convert_index", "hisparse_place", "hisparse_swap_in", "hisparse_prefill_plan",
              "stage_prefill_rows", "split_prefill_chunks", "reshape_query_for_spec_decode", "sparse_decode_fp8",
              "reshape_attn_output_for_spec_decode", "gather_fp8_prefill", "sparse_prefill"]


def needed_stages(kv_cache_dtype: str) -> list[str]:
    return list(BF16_STAGES if kv_cache_dtype == "bfloat16" else FP8_STAGES)


@dataclass(frozen=True)
class HiSparseTables:
    """The tiers' tables beside forward_mqa's metadata (module docstring; the host block table is
    the metadata's block table): one step's, shared by every layer of the group. The reference
    spells its own (`reference.hisparse.HiSparseTables`)."""

    residency: Tensor              # [max_seqs, M] state row -> GPU block of each page, 0 = not resident
    request_state_indices: Tensor  # [R] batch row -> state row, -1 = none
    hot_block_table: Tensor        # [R, ceil(D / B)] GPU blocks of a request's D hot slots
    device_global_indices: Tensor  # [max_seqs, D] host row each slot holds before the step, -1 empty
    lru_slots: Tensor              # [max_seqs, D] each state row's slots, least recently used first
    attention_block_stride: int    # S, rows a GPU block spans in the slab
    max_swap_rows: int             # a conversion of more rows takes the resident path


# ----------------------------------------------------------------------------- torch stages


@register("hisparse_place", "torch-fp32")
def hisparse_place(
    req_id: torch.Tensor, host_rows: torch.Tensor, resident_rows: torch.Tensor, tables: HiSparseTables,
    block_size: int, return_valid_counts: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Resolve residency and place misses: (physical [N, K] int32, counts [N] int32, src, dst int64).

    host_rows / resident_rows are the top-k converted through the host block table and through
    the residency table (stride S, idx_mapping): an entry >= S is a resident row, one below S a
    page with no resident block. Per state row, the missing host rows in first-appearance order
    take its least recently used slots (`tables.lru_slots`) among those holding no row the step
    needs. With counts the row is compacted stably."""
    request_state_indices, hot_block_table, lru_slots = tables.request_state_indices, tables.hot_block_table, \
        tables.lru_slots
    stride_rows = tables.attention_block_stride
    num_tokens, topk = host_rows.shape
    state = request_state_indices.long()[req_id.long()]
    valid = (host_rows >= 0) & (state[:, None] >= 0)
    resident = valid & (resident_rows >= stride_rows)
    need = valid & ~resident
    phys = torch.where(resident, resident_rows.long(), -1)
    dgi = tables.device_global_indices.long()
    srcs, dsts = [], []
    for s in torch.unique(state[need.any(dim=1)]).tolist():
        tokens = (state == s).nonzero().flatten()
        r = int(req_id[tokens[0]])
        mask = need[tokens]
        wanted = host_rows[tokens].long()[mask]              # row-major: the scan order
        uniq, inverse = torch.unique(wanted, return_inverse=True)
        scan = torch.arange(len(wanted), device=wanted.device)
        first = torch.full_like(uniq, len(wanted)).scatter_reduce(0, inverse, scan, "amin")
        held_sorted, held_slot = dgi[s].sort()
        pos = torch.searchsorted(held_sorted, uniq).clamp(max=len(held_sorted) - 1)
        hit = held_sorted[pos] == uniq
        slot = torch.where(hit, held_slot[pos], -1)
        missing = (~hit).nonzero().flatten()
        missing = missing[first[missing].argsort()]
        order = lru_slots[s].long()
        busy = torch.isin(dgi[s][order], uniq)                # holds a row this step needs
        free = order[~busy]
        if len(free) < len(missing):
            raise InputError(f"state row {s}: {len(missing)} missing rows but {len(free)} free hot slots")
        slot[missing] = free[: len(missing)]
        hot = hot_block_table.long()[r, slot // block_size] * stride_rows + slot % block_size
        srcs.append(uniq[missing])
        dsts.append(hot[missing])
        rows = phys[tokens]
        rows[mask] = hot[inverse]
        phys[tokens] = rows
    ok = phys >= 0
    out = buffers.empty((num_tokens, topk), torch.int32, phys.device)
    if return_valid_counts:
        dest = torch.where(ok, ok.cumsum(dim=1) - 1, topk)
        packed = torch.full((num_tokens, topk + 1), -1, dtype=torch.long, device=phys.device)
        out.copy_(packed.scatter_(1, dest, phys)[:, :topk])
    else:
        out.copy_(phys)
    counts = buffers.empty((num_tokens,), torch.int32, phys.device)
    counts.copy_(ok.sum(dim=1))
    empty = torch.zeros(0, dtype=torch.long, device=phys.device)
    return out, counts, torch.cat([empty, *srcs]), torch.cat([empty, *dsts])


def _host_rows_to(host_rows: torch.Tensor, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """host_rows[rows] on `device`: on CUDA gathered into pinned memory and copied asynchronously."""
    if host_rows.device == device:
        return host_rows[rows]
    picked = torch.empty((len(rows), host_rows.shape[1]), dtype=host_rows.dtype, pin_memory=True)
    torch.index_select(host_rows, 0, rows.cpu(), out=picked)
    return picked.to(device, non_blocking=True)


@register("hisparse_swap_in", "torch-fp32", priority=EAGER)
def hisparse_swap_in(host_rows: torch.Tensor, gpu_rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """hisparse_gather_compact: a copy of the slab [G, W] with host_rows[src[i]] written to row dst[i]."""
    out = gpu_rows.clone()
    out[dst] = _host_rows_to(host_rows, src, gpu_rows.device)
    return out


@register("hisparse_prefill_plan", "torch-fp32")
def hisparse_prefill_plan(
    prefill_block_table: torch.Tensor, prefill_seq_lens: Sequence[int], residency: torch.Tensor,
    prefill_state_rows: torch.Tensor, block_size: int, stride_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """build_hisparse_prefill_staging_plan + ensure_gpu_sources: (compact block table [P, M] int32,
    host source row [U * B], device source row [U * B] int64, -1 = take the host row).

    U = sorted unique({0} | host blocks of the prefills' pages); a staged block's device source
    is the resident block of the first prefill page (in request, then page order) naming it."""
    device = prefill_block_table.device
    num_prefills, width = prefill_block_table.shape
    pages = torch.tensor([-(-n // block_size) for n in prefill_seq_lens], device=device).reshape(num_prefills, 1)
    referenced = torch.arange(width, device=device)[None, :] < pages
    named = prefill_block_table.long()[referenced]
    blocks = torch.unique(torch.cat([torch.zeros(1, dtype=torch.long, device=device), named]))
    table = torch.where(referenced, torch.searchsorted(blocks, prefill_block_table.long()), 0).to(torch.int32)
    # The first reference of each block: the smallest flat (request, page) position naming it.
    flat = referenced.flatten().nonzero().flatten()
    first = torch.full((len(blocks),), num_prefills * width, dtype=torch.long, device=device)
    first.scatter_reduce_(0, torch.searchsorted(blocks, named), flat, "amin")
    found = first < num_prefills * width
    p, page = first.clamp(max=num_prefills * width - 1) // width, first.clamp(max=num_prefills * width - 1) % width
    res = torch.where(found & (blocks > 0), residency.long()[prefill_state_rows.long()[p], page], 0)
    offs = torch.arange(block_size, device=device)
    host = (blocks[:, None] * block_size + offs).flatten()
    dev = torch.where(res[:, None] > 0, res[:, None] * stride_rows + offs, -1).flatten()
    return table, host, dev


@register("stage_prefill_rows", "torch-fp32")
def stage_prefill_rows(
    host_rows: torch.Tensor, gpu_rows: torch.Tensor, host_row_ids: torch.Tensor, device_row_ids: torch.Tensor,
    req_id_per_token: torch.Tensor, num_decodes: int, num_decode_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """stage_prefill_rows: (staged rows [U * B, W]: device row where there is one, else the host
    row; req ids of the prefill tokens, rebased by num_decodes to index the plan's table)."""
    staged = _host_rows_to(host_rows, host_row_ids, gpu_rows.device)
    on_device = device_row_ids >= 0
    staged[on_device] = gpu_rows[device_row_ids[on_device]]
    return staged, (req_id_per_token[num_decode_tokens:] - num_decodes).to(torch.int32)


def _gather_fp8_prefill(gather):
    def gather_fp8_prefill(staged_rows: torch.Tensor, block_table: torch.Tensor, workspace_starts: torch.Tensor,
                           batch_size: int, request_start: int, num_rows: int, block_size: int) -> torch.Tensor:
        """gather_fp8_prefill: the chunk's workspace from the staged rows through the plan's table
        rows [request_start, request_start + batch_size) (the chunk's own table is ignored)."""
        table = block_table[request_start : request_start + batch_size]
        return gather(kv_cache=staged_rows.view(-1, block_size, staged_rows.shape[-1]), block_table=table,
                      workspace_starts=workspace_starts, num_rows=num_rows)

    return gather_fp8_prefill


register("gather_fp8_prefill", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",))(
    _gather_fp8_prefill(triton_gather.gather_upconvert_fp8))
register("gather_fp8_prefill", "torch-fp32", priority=EAGER)(_gather_fp8_prefill(eager.gather_upconvert_fp8))


# ----------------------------------------------------------------------------- the pipeline


def all_context_pages_resident(seq_lens: Sequence[int], residency: torch.Tensor, state_rows: torch.Tensor,
                               block_size: int) -> bool:
    """The scheduler's flag: every page of every request has a resident block."""
    pages = torch.tensor([-(-n // block_size) for n in seq_lens], device=residency.device)
    if bool((state_rows[pages > 0] < 0).any()):
        return False
    cols = torch.arange(residency.shape[1], device=residency.device)[None, :] < pages[:, None]
    return bool((residency[state_rows.long().clamp(min=0)] > 0)[cols].all())


def forward_mqa_hisparse(
    q_layers: Sequence[Tensor], host_caches: Sequence[Tensor], gpu_rows: Sequence[Tensor], topk_indices: Tensor,
    metadata: MQAMetadata, tables: HiSparseTables, group_buffer: tuple[Tensor, Tensor], stages: Resolved | None = None,
) -> list[PipelineResult]:
    """Every layer of one index group over one shared top-k (module docstring); one result per
    layer. `metadata.block_table` is the host block table; `group_buffer` the index group's
    persistent (physical, counts) buffers as a previous step left them."""
    m, device = metadata, gpu_rows[0].device
    if stages is None:
        stages = resolve(needed_stages(m.kv_cache_dtype), device.type)
    bs = host_caches[0].shape[1]
    num_tokens = q_layers[0].shape[0]
    split = split_decodes_and_prefills(m.query_start_loc, m.max_decode_query_len)  # HiSparse: threshold 1 (+ spec)
    step = _Step(req_id_per_token(m.query_start_loc, num_tokens, device), topk_indices[:num_tokens], m, tables, bs,
                 split, all_context_pages_resident(m.seq_lens, tables.residency, tables.request_state_indices, bs),
                 stages, stages.fn("index_group")(physical=group_buffer[0], counts=group_buffer[1]))
    layers = list(zip(q_layers, host_caches, gpu_rows))
    return _bf16(step, layers) if m.kv_cache_dtype == "bfloat16" else _fp8(step, layers)


@dataclass(frozen=True)
class _Step:
    """What every layer of the group shares: the step's tokens, tables, split, stages and group."""

    req_id: Tensor          # [T] int32 request of each token
    topk: Tensor            # [T, K] logical top-k
    m: MQAMetadata
    tables: HiSparseTables
    block_size: int
    split: BatchSplit
    resident_all: bool      # every context page of every request resident
    stages: Resolved
    group: IndexGroup

    def route(self, layer: int, rows: slice, counts: bool, host: Tensor, slab: Tensor):
        """(indices, counts, this layer's slab after its swaps): resident path or swap-in."""
        t, convert = self.tables, self.stages.fn("convert_index")
        prefills = self.split.num_decode_tokens < self.topk.shape[0]
        req_id, topk, bs = self.req_id[rows], self.topk[rows], self.block_size
        if rows.stop - rows.start > t.max_swap_rows or (self.resident_all and prefills):
            if not self.resident_all:
                raise InputError("the resident path needs every context page resident (non-resident prefills are "
                                 "staged)")
            res = self.group.convert_once(layer, convert, counts, req_id=req_id, block_table=t.residency,
                                          topk_indices=topk, block_size=bs, block_stride_rows=t.attention_block_stride,
                                          idx_mapping=t.request_state_indices)
            return (*res, slab) if counts else (res, None, slab)

        def resolve_step() -> SwapIn:
            host_idx = convert(req_id=req_id, block_table=self.m.block_table, topk_indices=topk, block_size=bs)
            res_idx = convert(req_id=req_id, block_table=t.residency, topk_indices=topk, block_size=bs,
                              block_stride_rows=t.attention_block_stride, idx_mapping=t.request_state_indices)
            return SwapIn(*self.stages.fn("hisparse_place")(
                req_id=req_id, host_rows=host_idx, resident_rows=res_idx, tables=t, block_size=bs,
                return_valid_counts=counts))

        copy = self.stages.fn("hisparse_swap_in")
        sw, hot = self.group.swap_in(layer, resolve_step, copy, host.view(-1, slab.shape[-1]), slab)
        return sw.physical, sw.counts, hot

    def staging_plan(self) -> tuple[Tensor, Tensor, Tensor]:
        """The prefills' staging plan (`hisparse_prefill_plan`): compact table, host and device source rows."""
        nreq, t = self.split.num_decodes, self.tables
        return self.stages.fn("hisparse_prefill_plan")(
            prefill_block_table=self.m.block_table[nreq:], prefill_seq_lens=list(self.m.seq_lens[nreq:]),
            residency=t.residency, prefill_state_rows=t.request_state_indices[nreq:], block_size=self.block_size,
            stride_rows=t.attention_block_stride)

    def staged(self, plan: tuple[Tensor, Tensor, Tensor], host: Tensor, slab: Tensor) -> tuple[Tensor, Tensor]:
        """This layer's staged rows and the prefill tokens' rebased req ids (`stage_prefill_rows`)."""
        return self.stages.fn("stage_prefill_rows")(
            host_rows=host.view(-1, slab.shape[-1]), gpu_rows=slab, host_row_ids=plan[1], device_row_ids=plan[2],
            req_id_per_token=self.req_id, num_decodes=self.split.num_decodes,
            num_decode_tokens=self.split.num_decode_tokens)


def _empty(q: Tensor) -> tuple[Tensor, Tensor]:
    num_tokens, num_heads = q.shape[:2]
    return (buffers.empty((num_tokens, num_heads, V_DIM), torch.bfloat16, q.device),
            buffers.empty((num_tokens, num_heads), torch.float32, q.device))


def _bf16(step: _Step, layers: list[tuple[Tensor, Tensor, Tensor]]) -> list[PipelineResult]:
    """`_forward_bf16_kv` under HiSparse, branches A-C (`reference.hisparse`)."""
    m, bs, nd, num_tokens = step.m, step.block_size, step.split.num_decode_tokens, step.topk.shape[0]
    whole = nd < num_tokens and step.resident_all   # branch A: one resident conversion for every token
    plan = step.staging_plan() if nd < num_tokens and not whole else None
    prefill, convert = step.stages.fn("sparse_prefill"), step.stages.fn("convert_index")
    results = []
    for layer, (q, host, slab) in enumerate(layers):
        out, lse = _empty(q)
        if plan is not None:
            staged, rid = step.staged(plan, host, slab)
        if nd or whole:
            n = num_tokens if whole else nd
            idx, cnt, hot = step.route(layer, slice(0, n), True, host, slab)
            res = prefill(q=q[:n], kv=hot, indices=idx, sm_scale=m.sm_scale, topk_length=cnt)
            out[:n], lse[:n] = res[0], res[1]
        if plan is not None:
            idx, cnt = convert(req_id=rid, block_table=plan[0], topk_indices=step.topk[nd:], block_size=bs,
                               block_stride_rows=bs, return_valid_counts=True)
            res = prefill(q=q[nd:], kv=staged, indices=idx, sm_scale=m.sm_scale, topk_length=cnt)
            out[nd:], lse[nd:] = res[0], res[1]
        results.append(PipelineResult(out, lse, "bf16_hisparse", step.stages))
    return results


def _fp8(step: _Step, layers: list[tuple[Tensor, Tensor, Tensor]]) -> list[PipelineResult]:
    """`_forward_fp8_kv_separate_prefill_decode` under HiSparse (`reference.hisparse`): decodes
    through swap-in and the decode kernel over the slab, prefills chunk by chunk from the staged rows."""
    m, nd, num_tokens = step.m, step.split.num_decode_tokens, step.topk.shape[0]
    staging = step.staging_plan() if nd < num_tokens else None
    if staging is not None:
        plan = plan_prefill(m.query_start_loc, m.seq_lens, step.split,
                            m.workspace_size or prefill_workspace_size(m.max_model_len), step.topk.device,
                            step.stages.fn("split_prefill_chunks"))
        ws_idx, ws_counts = step.stages.fn("convert_index")(
            req_id=step.req_id, block_table=m.block_table, topk_indices=step.topk, block_size=step.block_size,
            prefill_request_ids=plan.request_ids, prefill_workspace_starts=plan.workspace_starts,
            return_valid_counts=True)
    results = []
    for layer, (q, host, slab) in enumerate(layers):
        out, lse = _empty(q)
        if staging is not None:
            staged, _ = step.staged(staging, host, slab)
        if nd:
            out[:nd], lse[:nd] = _decodes(step, layer, q[:nd], host, slab)
        for chunk in plan.chunks if staging is not None else ():
            t = chunk.tokens
            out[t], lse[t] = _staged_chunk(step, q[t], staged, staging[0], chunk, ws_idx[t], ws_counts[t])
        results.append(PipelineResult(out, lse, "fp8_separate_hisparse", step.stages))
    return results


def _decodes(step: _Step, layer: int, q: Tensor, host: Tensor, slab: Tensor) -> tuple[Tensor, Tensor]:
    """The decode tokens: the logical top-k, taken before any prefill conversion (-1 stays in place),
    through swap-in, then the decode kernel over the slab as [active, s, H, 576]."""
    nd, bs, stages = q.shape[0], step.block_size, step.stages
    idx, _, hot = step.route(layer, slice(0, nd), False, host, slab)
    _, active = active_decodes(step.m.query_start_loc, step.split)
    q_d = stages.fn("reshape_query_for_spec_decode")(q=q, num_decodes=active)
    out_d, lse_d = stages.fn("sparse_decode_fp8")(
        q=q_d, kv_cache=hot.view(-1, bs, slab.shape[-1]), indices=idx.view(active, q_d.shape[1], -1),
        sm_scale=step.m.sm_scale)
    return stages.fn("reshape_attn_output_for_spec_decode")(out=out_d), lse_d.transpose(1, 2).reshape(-1, q.shape[1])


def _staged_chunk(step: _Step, q: Tensor, staged: Tensor, plan_table: Tensor, chunk: PrefillChunk, idx: Tensor,
                  counts: Tensor) -> tuple[Tensor, Tensor]:
    """One prefill chunk: its workspace gathered from the staged rows on the prefill stream
    (`gather_fp8_prefill`), then the BF16 prefill kernel over it."""
    group, nreq = step.group, step.split.num_decodes
    with group.streams.on(group.streams.prefill):
        workspace = step.stages.fn("gather_fp8_prefill")(
            staged_rows=staged, block_table=plan_table, workspace_starts=chunk.workspace_starts,
            batch_size=chunk.requests.stop - chunk.requests.start, request_start=chunk.requests.start - nreq,
            num_rows=chunk.total_rows, block_size=step.block_size)
        ready = group.streams.record(group.streams.prefill)
    group.streams.wait(ready, workspace)
    res = step.stages.fn("sparse_prefill")(q=q, kv=workspace, indices=idx, sm_scale=step.m.sm_scale,
                                           topk_length=counts)
    return res[0], res[1]
