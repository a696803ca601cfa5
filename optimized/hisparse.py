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

from typing import Sequence

import torch

from . import buffers, eager
from .index_group import SwapIn
from .kernels import gather as triton_gather
from .metadata import active_decodes, plan_prefill, prefill_workspace_size, req_id_per_token, split_decodes_and_prefills
from .pipeline import V_DIM, PipelineResult
from .registry import EAGER, TRITON, Resolved, register, resolve
from .validation import InputError

BF16_STAGES = ["index_group", "convert_index", "hisparse_place", "hisparse_swap_in", "hisparse_prefill_plan",
               "stage_prefill_rows", "sparse_prefill"]
FP8_STAGES = ["index_group", "convert_index", "hisparse_place", "hisparse_swap_in", "hisparse_prefill_plan",
              "stage_prefill_rows", "split_prefill_chunks", "reshape_query_for_spec_decode", "sparse_decode_fp8",
              "reshape_attn_output_for_spec_decode", "gather_fp8_prefill", "sparse_prefill"]


def needed_stages(kv_cache_dtype: str) -> list[str]:
    return list(BF16_STAGES if kv_cache_dtype == "bfloat16" else FP8_STAGES)


# ----------------------------------------------------------------------------- torch stages


@register("hisparse_place", "torch-fp32")
def hisparse_place(
    req_id: torch.Tensor, host_rows: torch.Tensor, resident_rows: torch.Tensor, request_state_indices: torch.Tensor,
    hot_block_table: torch.Tensor, device_global_indices: torch.Tensor, lru_slots: torch.Tensor, block_size: int,
    stride_rows: int, return_valid_counts: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Resolve residency and place misses: (physical [N, K] int32, counts [N] int32, src, dst int64).

    host_rows / resident_rows are the top-k converted through the host block table and through
    the residency table (stride S, idx_mapping): an entry >= S is a resident row, one below S a
    page with no resident block. Per state row, the missing host rows in first-appearance order
    take its least recently used slots among those holding no row the step needs. With counts the
    row is compacted stably."""
    num_tokens, topk = host_rows.shape
    state = request_state_indices.long()[req_id.long()]
    valid = (host_rows >= 0) & (state[:, None] >= 0)
    resident = valid & (resident_rows >= stride_rows)
    need = valid & ~resident
    phys = torch.where(resident, resident_rows.long(), -1)
    dgi = device_global_indices.long()
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
    q_layers: Sequence[torch.Tensor], host_caches: Sequence[torch.Tensor], gpu_rows: Sequence[torch.Tensor], *,
    query_start_loc: Sequence[int], seq_lens: Sequence[int], topk_indices: torch.Tensor, kv_cache_dtype: str,
    sm_scale: float, max_model_len: int, host_block_table: torch.Tensor, residency: torch.Tensor,
    request_state_indices: torch.Tensor, hot_block_table: torch.Tensor, device_global_indices: torch.Tensor,
    lru_slots: torch.Tensor, attention_block_stride: int, max_swap_rows: int,
    group_buffer: tuple[torch.Tensor, torch.Tensor], workspace_size: int | None = None, max_decode_query_len: int = 1,
    stages: Resolved | None = None,
) -> list[PipelineResult]:
    """Every layer of one index group over one shared top-k (module docstring); one result per layer."""
    device = gpu_rows[0].device
    if stages is None:
        stages = resolve(needed_stages(kv_cache_dtype), device.type)
    bf16 = kv_cache_dtype == "bfloat16"
    bs, stride, width = host_caches[0].shape[1], attention_block_stride, gpu_rows[0].shape[-1]
    num_tokens, num_heads = q_layers[0].shape[:2]
    topk = topk_indices[:num_tokens]
    req_id = req_id_per_token(query_start_loc, num_tokens, device)
    split = split_decodes_and_prefills(query_start_loc, max_decode_query_len)  # HiSparse: threshold 1 (+ spec)
    nd, nreq = split.num_decode_tokens, split.num_decodes
    resident_all = all_context_pages_resident(seq_lens, residency, request_state_indices, bs)
    convert = stages.fn("convert_index")
    group = stages.fn("index_group")(physical=group_buffer[0], counts=group_buffer[1])

    def route(layer: int, rows: slice, counts: bool, host: torch.Tensor, slab: torch.Tensor):
        """(indices, counts, this layer's slab after its swaps): resident path or swap-in."""
        n = rows.stop - rows.start
        if n > max_swap_rows or (resident_all and nd < num_tokens):
            if not resident_all:
                raise InputError("the resident path needs every context page resident (non-resident prefills are staged)")
            res = group.convert_once(layer, convert, counts, req_id=req_id[rows], block_table=residency,
                                     topk_indices=topk[rows], block_size=bs, block_stride_rows=stride,
                                     idx_mapping=request_state_indices)
            return (*res, slab) if counts else (res, None, slab)

        def resolve_step() -> SwapIn:
            host_idx = convert(req_id=req_id[rows], block_table=host_block_table, topk_indices=topk[rows], block_size=bs)
            res_idx = convert(req_id=req_id[rows], block_table=residency, topk_indices=topk[rows], block_size=bs,
                              block_stride_rows=stride, idx_mapping=request_state_indices)
            return SwapIn(*stages.fn("hisparse_place")(
                req_id=req_id[rows], host_rows=host_idx, resident_rows=res_idx,
                request_state_indices=request_state_indices, hot_block_table=hot_block_table,
                device_global_indices=device_global_indices, lru_slots=lru_slots, block_size=bs,
                stride_rows=stride, return_valid_counts=counts))

        sw, hot = group.swap_in(layer, resolve_step, stages.fn("hisparse_swap_in"), host.view(-1, width), slab)
        return sw.physical, sw.counts, hot

    whole = bf16 and nd < num_tokens and resident_all   # branch A: one resident conversion for every token
    staged_needed = nd < num_tokens and not whole
    if staged_needed:
        plan_table, host_ids, dev_ids = stages.fn("hisparse_prefill_plan")(
            prefill_block_table=host_block_table[nreq:], prefill_seq_lens=list(seq_lens[nreq:]), residency=residency,
            prefill_state_rows=request_state_indices[nreq:], block_size=bs, stride_rows=stride)
    if not bf16 and nd < num_tokens:
        plan = plan_prefill(query_start_loc, seq_lens, split, workspace_size or prefill_workspace_size(max_model_len),
                            device, stages.fn("split_prefill_chunks"))
        ws_idx, ws_counts = convert(req_id=req_id, block_table=host_block_table, topk_indices=topk, block_size=bs,
                                    prefill_request_ids=plan.request_ids, prefill_workspace_starts=plan.workspace_starts,
                                    return_valid_counts=True)

    results = []
    for layer, (q, host, slab) in enumerate(zip(q_layers, host_caches, gpu_rows)):
        out = buffers.empty((num_tokens, num_heads, V_DIM), torch.bfloat16, device)
        lse = buffers.empty((num_tokens, num_heads), torch.float32, device)
        prefill = stages.fn("sparse_prefill")
        if staged_needed:
            staged, rid = stages.fn("stage_prefill_rows")(
                host_rows=host.view(-1, width), gpu_rows=slab, host_row_ids=host_ids, device_row_ids=dev_ids,
                req_id_per_token=req_id, num_decodes=nreq, num_decode_tokens=nd)
        if bf16:
            if nd or whole:
                n = num_tokens if whole else nd
                idx, cnt, hot = route(layer, slice(0, n), True, host, slab)
                res = prefill(q=q[:n], kv=hot, indices=idx, sm_scale=sm_scale, topk_length=cnt)
                out[:n], lse[:n] = res[0], res[1]
            if staged_needed:
                idx, cnt = convert(req_id=rid, block_table=plan_table, topk_indices=topk[nd:], block_size=bs,
                                   block_stride_rows=bs, return_valid_counts=True)
                res = prefill(q=q[nd:], kv=staged, indices=idx, sm_scale=sm_scale, topk_length=cnt)
                out[nd:], lse[nd:] = res[0], res[1]
        else:
            if nd:
                # The logical decode top-k, taken before any prefill conversion; -1 stays in place.
                idx, _, hot = route(layer, slice(0, nd), False, host, slab)
                _, active = active_decodes(query_start_loc, split)
                q_d = stages.fn("reshape_query_for_spec_decode")(q=q[:nd], num_decodes=active)
                out_d, lse_d = stages.fn("sparse_decode_fp8")(
                    q=q_d, kv_cache=hot.view(-1, bs, width), indices=idx.view(active, q_d.shape[1], -1), sm_scale=sm_scale)
                out[:nd] = stages.fn("reshape_attn_output_for_spec_decode")(out=out_d)
                lse[:nd] = lse_d.transpose(1, 2).reshape(-1, num_heads)
            for chunk in plan.chunks if nd < num_tokens else ():
                with group.streams.on(group.streams.prefill):
                    workspace = stages.fn("gather_fp8_prefill")(
                        staged_rows=staged, block_table=plan_table, workspace_starts=chunk.workspace_starts,
                        batch_size=chunk.requests.stop - chunk.requests.start, request_start=chunk.requests.start - nreq,
                        num_rows=chunk.total_rows, block_size=bs)
                    ready = group.streams.record(group.streams.prefill)
                group.streams.wait(ready, workspace)
                t = chunk.tokens
                res = prefill(q=q[t], kv=workspace, indices=ws_idx[t], sm_scale=sm_scale, topk_length=ws_counts[t])
                out[t], lse[t] = res[0], res[1]
        results.append(PipelineResult(out, lse, "bf16_hisparse" if bf16 else "fp8_separate_hisparse", stages))
    return results
