"""HiSparse (host-backed KV): `forward_mqa` when the logical cache lives in host memory and the
device holds resident pages plus a smaller "hot" cache of the rows a step needs (vLLM 0.33
`vllm/v1/hisparse`, `HiSparseMLAIndexGroup`). Every row a kernel reads is a byte copy of a
logical row, so the answer is the plain path's on the logical cache; the model below makes each
relocation explicit so a wrong physical index selects a different row.

Tiers and tables (B = block size, S = attention block stride in rows, S >= B, S % B == 0):
    host_caches[l]         [HB, B, W] layer l's host cache; host row h = block * B + offset
    gpu_rows[l]            [NG * S, W] layer l's device slab as flat rows: GPU block g, offset o
                           is row g * S + o; resident pages and hot blocks share it
    host_block_table       [R, M] batch row -> host block of each page
    residency              [max_seqs, M] state row -> GPU block of each page, 0 = not resident
    request_state_indices  [R] batch row -> state row (the converter's idx_mapping), -1 = none
    hot_block_table        [R, ceil(D / B)] GPU blocks of a request's D hot slots: slot k is
                           row hot_block_table[r, k // B] * S + k % B
    device_global_indices  [max_seqs, D] host row held by each slot before the step, -1 empty
    lru_slots              [max_seqs, D] each state row's slots, least recently used first

    L(r, i) = gpu_rows[residency[s, i//B] * S + i%B]        if residency[s, i//B] != 0
            = host_rows[host_block_table[r, i//B] * B + i%B] otherwise          (s = state row)

A resident page's host copy may be stale (not mirrored yet): the resident copy wins.

Routing (`convert_logical_to_physical_topk`; all_resident = every page of every request resident):
    N > max_swap_rows, or all_resident with prefill tokens -> resident path: the plain converter
        through `residency` with idx_mapping = request_state_indices and stride S;
    otherwise swap_in (below).
bf16 cache (`_forward_bf16_kv`, wheel 0.33; nd = decode tokens, threshold 1 + spec):
    A  nd < T and all_resident: every token through the resident path and the BF16 kernel;
    B  nd > 0: decode tokens via swap_in (counts) and the BF16 kernel over the slab;
    C  prefill tokens via the staged cache: req ids rebased by num_decodes, converted through the
       staged block table (stride B, counts), the BF16 kernel over the staged rows;
    outputs of B and C concatenated. The backend returns LSE None when decodes are present; we
    return every row's LSE anyway (the harness's sharpest signal, as the plain paths do).
fp8_ds_mla cache (`_forward_fp8_kv_separate_prefill_decode`, always separate under HiSparse):
    decode tokens: the logical top-k (taken before any conversion) through swap_in without counts
    (-1 in place), the FP8 decode kernel over the slab as [NG * S / B, B, 656] pages;
    prefill tokens: workspace rows (plain converter, prefill workspace mode), chunk by chunk a
    gather of the chunk's rows from the staged sources (`gather_fp8_prefill`, the plan's block
    table rows [request_start, request_start + batch)) up-converted, then the BF16 kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from .attention import AttentionResult, sparse_decode, sparse_prefill
from .forward import MQAMetadata, MQAResult
from .indices import convert_index, req_id_per_token
from .metadata import (
    BatchSplit,
    PrefillChunk,
    active_decodes,
    plan_prefill,
    prefill_workspace_size,
    split_decodes_and_prefills,
)
from .query import reshape_attn_output_for_spec_decode, reshape_query_for_spec_decode
from .workspace import gather_upconvert_fp8


@dataclass(frozen=True)
class HiSparseTables:
    """The tiers' tables beside forward_mqa's metadata (module docstring; the host block table is
    the metadata's block table): one step's, shared by every layer of the group. The optimized
    side spells its own (`optimized.hisparse.HiSparseTables`)."""

    residency: Tensor              # [max_seqs, M] state row -> GPU block of each page, 0 = not resident
    request_state_indices: Tensor  # [R] batch row -> state row, -1 = none
    hot_block_table: Tensor        # [R, ceil(D / B)] GPU blocks of a request's D hot slots
    device_global_indices: Tensor  # [max_seqs, D] host row each slot holds before the step, -1 empty
    lru_slots: Tensor              # [max_seqs, D] each state row's slots, least recently used first
    attention_block_stride: int    # S, rows a GPU block spans in the slab
    max_swap_rows: int             # a conversion of more rows takes the resident path


@dataclass(frozen=True)
class Swaps:
    """One step's swap-in, shared by every layer of the group."""

    physical: torch.Tensor   # [N, K] int32 slab rows (-1 invalid); compacted iff counts asked
    counts: torch.Tensor     # [N] int32 valid entries per row
    host_rows: list[int]     # host row copied ...
    hot_rows: list[int]      # ... into this slab row, in order


def all_context_pages_resident(seq_lens: Sequence[int], residency: torch.Tensor, state_rows: torch.Tensor,
                               block_size: int) -> bool:
    """Every page 0 .. ceil(seq_len / B) - 1 of every request has a resident block."""
    for r, n in enumerate(seq_lens):
        pages = -(-n // block_size)
        s = int(state_rows[r])
        if pages and (s < 0 or bool((residency[s, :pages] == 0).any())):
            return False
    return True


def swap_in(
    req_id: Tensor, topk: Tensor, host_block_table: Tensor, tables: HiSparseTables, *, block_size: int,
    return_valid_counts: bool,
) -> Swaps:
    """`hisparse_resolve_residency` as a deterministic policy (module docstring). Scans rows t, then
    columns j; for request r (state s >= 0), valid logical i (i >= 0, i // B < M):
        resident:  phys = residency[s, i//B] * S + i%B
        hot hit:   slot k with dgi[s, k] = h = host_block_table[r, i//B] * B + i%B
        miss:      k = the least recently used slot of s neither used this step nor holding a row
                   the step needs; dgi[s, k] = h and the swap (h -> hot row of k) is listed
        phys = hot_block_table[r, k//B] * S + k%B; hits and misses become most recently used.
    A step never evicts a row it needs (a request's union fits its D slots). With counts the valid
    entries are compacted stably to the front. The policy walks the tables on the host (one read
    each, not one device sync per entry); the physical indices come back on topk's device."""
    device, shape, tb = topk.device, tuple(topk.shape), tables
    # Plain lists: the policy walks every entry, and a tensor read or op per entry cost ~0.1 s a step.
    req_id, topk, host_block_table, residency, request_state_indices, hot_block_table, device_global_indices, \
        lru_slots = (x.tolist() for x in (req_id, topk, host_block_table, tb.residency, tb.request_state_indices,
                                           tb.hot_block_table, tb.device_global_indices, tb.lru_slots))
    bs, width, stride_rows = block_size, len(host_block_table[0]) if host_block_table else 0, tb.attention_block_stride

    def entries(t: int):
        """(r, s, i) of token t's valid logical entries, with their column j."""
        r = req_id[t]
        s = request_state_indices[r]
        for j, i in enumerate(topk[t]):
            if s >= 0 and 0 <= i and i // bs < width:
                yield j, r, s, i

    needed: dict[int, set[int]] = {}
    for t in range(len(topk)):
        for _, r, s, i in entries(t):
            if not residency[s][i // bs]:
                needed.setdefault(s, set()).add(host_block_table[r][i // bs] * bs + i % bs)
    dgi = [list(row) for row in device_global_indices]
    holders = [{} for _ in dgi]  # state -> host row -> the slots holding it (dgi inverted)
    for s, row in enumerate(dgi):
        for k, h in enumerate(row):
            holders[s].setdefault(h, set()).add(k)
    lru = [dict.fromkeys(row) for row in lru_slots]  # slots in order, least recently used first
    used: dict[int, set[int]] = {}
    phys = [[-1] * len(row) for row in topk]
    host_rows, hot_rows = [], []
    for t in range(len(topk)):
        for j, r, s, i in entries(t):
            page, off = i // bs, i % bs
            if residency[s][page]:
                phys[t][j] = residency[s][page] * stride_rows + off
                continue
            h = host_block_table[r][page] * bs + off
            if h in holders[s]:
                k = min(holders[s][h])
            else:
                k = next(k for k in lru[s] if k not in used.get(s, set()) and dgi[s][k] not in needed[s])
                holders[s][dgi[s][k]].discard(k)
                if not holders[s][dgi[s][k]]:
                    del holders[s][dgi[s][k]]
                dgi[s][k] = h
                holders[s][h] = {k}
                host_rows.append(h)
                hot_rows.append(hot_block_table[r][k // bs] * stride_rows + k % bs)
            used.setdefault(s, set()).add(k)
            lru[s][k] = lru[s].pop(k)  # most recently used: to the end
            phys[t][j] = hot_block_table[r][k // bs] * stride_rows + k % bs
    phys = torch.tensor(phys, dtype=torch.int64).reshape(shape)
    valid = phys >= 0
    if return_valid_counts:
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
        phys = phys.gather(1, order)
    return Swaps(phys.to(device, torch.int32), valid.sum(dim=1).to(device, torch.int32), host_rows, hot_rows)


def apply_swaps(host_cache: torch.Tensor, gpu_rows: torch.Tensor, swaps: Swaps) -> torch.Tensor:
    """`hisparse_gather_compact`: a copy of the slab with each listed host row copied byte for byte
    into its hot row."""
    out = gpu_rows.clone()
    host = host_cache.reshape(-1, host_cache.shape[-1])
    # One indexed copy: a step fills each hot row at most once (a slot used in a step is not evicted in it).
    hot, rows = (torch.tensor(x, dtype=torch.int64, device=gpu_rows.device) for x in (swaps.hot_rows, swaps.host_rows))
    out[hot] = host[rows.to(host.device)].to(out.device)
    return out


def staged_prefill_rows(
    host_cache: torch.Tensor, gpu_rows: torch.Tensor, *, prefill_block_table: torch.Tensor,
    prefill_seq_lens: Sequence[int], residency: torch.Tensor, prefill_state_rows: torch.Tensor, stride_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`build_hisparse_prefill_staging_plan` + `ensure_gpu_sources` + `stage_prefill_rows`.

    U = sorted({0} | host blocks of pages 0 .. ceil(seq_len_p / B) - 1 of the prefills). The
    staged block table maps those pages to their index in U (0 elsewhere). Staged block u holds,
    row for row, the logical rows of host block U[u] as the first prefill referencing it sees
    them: its resident block's rows if that page is resident for it, else the host rows. Returns
    (staged rows [|U| * B, W], staged block table [P, M] int32)."""
    bs = host_cache.shape[1]
    device = prefill_block_table.device
    prefill_block_table, residency, prefill_state_rows = (t.cpu() for t in (prefill_block_table, residency,
                                                                            prefill_state_rows))
    first_ref: dict[int, tuple[int, int]] = {}
    for p, n in enumerate(prefill_seq_lens):
        for page in range(-(-n // bs)):
            first_ref.setdefault(int(prefill_block_table[p, page]), (p, page))
    blocks = sorted({0} | set(first_ref))
    compact = {b: u for u, b in enumerate(blocks)}
    table = torch.zeros_like(prefill_block_table)
    for p, n in enumerate(prefill_seq_lens):
        for page in range(-(-n // bs)):
            table[p, page] = compact[int(prefill_block_table[p, page])]
    staged = []
    for b in blocks:
        p, page = first_ref.get(b, (None, None))
        resident = int(residency[int(prefill_state_rows[p]), page]) if p is not None and b else 0
        staged.append(gpu_rows[resident * stride_rows : resident * stride_rows + bs] if resident else host_cache[b])
    return torch.cat(staged), table.to(device)


def forward_mqa_hisparse(
    q_layers: Sequence[Tensor],
    host_caches: Sequence[Tensor],
    gpu_rows: Sequence[Tensor],
    topk_indices: Tensor,
    metadata: MQAMetadata,
    tables: HiSparseTables,
    *,
    dtype: torch.dtype = torch.float64,
) -> list[MQAResult]:
    """Every layer of one index group on one shared top-k (module docstring): one swap-in,
    applied to each layer's own slab. `metadata.block_table` is the host block table. Returns one
    MQAResult per layer."""
    m, bs = metadata, host_caches[0].shape[1]
    host_caches = [h.to(g.device) for h, g in zip(host_caches, gpu_rows)]  # pinned host memory on CUDA
    num_tokens = q_layers[0].shape[0]
    req_id = req_id_per_token(m.query_start_loc, num_tokens).to(topk_indices.device)
    step = _Step(req_id, topk_indices[:num_tokens], m, tables, bs,
                 # The HiSparse builder's reorder threshold is 1, raised to the spec-decode query length.
                 split_decodes_and_prefills(m.query_start_loc, m.max_decode_query_len),
                 all_context_pages_resident(m.seq_lens, tables.residency, tables.request_state_indices, bs))
    layers = list(zip(q_layers, host_caches, gpu_rows))
    return _bf16(step, layers, dtype) if m.kv_cache_dtype == "bfloat16" else _fp8(step, layers, dtype)


@dataclass(frozen=True)
class _Step:
    """What every layer of the group shares: the step's tokens, tables and split."""

    req_id: Tensor          # [T] request of each token
    topk: Tensor            # [T, K] logical top-k
    m: MQAMetadata
    tables: HiSparseTables
    block_size: int
    split: BatchSplit
    resident_all: bool      # every context page of every request resident

    def convert(self, rows: slice, counts: bool) -> tuple[Tensor, Tensor, Swaps | None]:
        """Routing (module docstring): more than max_swap_rows rows, or every page resident with
        prefill tokens present, through the resident path (the plain converter over `residency`,
        idx_mapping = request_state_indices, stride S); otherwise swap_in. (indices, counts, swaps)."""
        t, prefills = self.tables, self.split.num_decode_tokens < self.topk.shape[0]
        if rows.stop - rows.start > t.max_swap_rows or (self.resident_all and prefills):
            if not self.resident_all:
                raise ValueError("the resident path needs every context page resident (non-resident prefills are "
                                 "staged)")
            idx = convert_index(self.req_id[rows], t.residency, self.topk[rows], self.block_size,
                                t.attention_block_stride, return_valid_counts=counts,
                                idx_mapping=t.request_state_indices)
            return (*idx, None) if counts else (idx, (idx >= 0).sum(1).to(torch.int32), None)
        sw = swap_in(self.req_id[rows], self.topk[rows], self.m.block_table, t, block_size=self.block_size,
                     return_valid_counts=counts)
        return sw.physical, sw.counts, sw

    def staged(self, host_cache: Tensor, slab: Tensor) -> tuple[Tensor, Tensor]:
        """The prefills' staged rows and block table from this layer's tiers (`staged_prefill_rows`)."""
        nreq = self.split.num_decodes
        return staged_prefill_rows(host_cache, slab, prefill_block_table=self.m.block_table[nreq:],
                                   prefill_seq_lens=list(self.m.seq_lens[nreq:]), residency=self.tables.residency,
                                   prefill_state_rows=self.tables.request_state_indices[nreq:],
                                   stride_rows=self.tables.attention_block_stride)


def _empty(q: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """out [T, H, 512], lse [T, H], logit_l1 [T, H], zero."""
    lse = q.new_zeros(q.shape[:2], dtype=dtype)
    return q.new_zeros((*q.shape[:2], 512), dtype=dtype), lse, torch.zeros_like(lse)


def _bf16(step: _Step, layers: list[tuple[Tensor, Tensor, Tensor]], dtype: torch.dtype) -> list[MQAResult]:
    """bf16 cache, branches A-C (module docstring): A every token through the resident path when
    every page is resident; else B the D decode tokens through swap_in (counts) and the BF16
    kernel over the slab after the swaps, and C the prefill tokens through the staged cache (req
    ids rebased by num_decodes, stride B, counts) and the BF16 kernel over the staged rows."""
    m, nd, num_tokens = step.m, step.split.num_decode_tokens, step.topk.shape[0]
    whole = nd < num_tokens and step.resident_all
    staged = [step.staged(h, g) for _, h, g in layers] if nd < num_tokens and not whole else None
    dec = step.convert(slice(0, num_tokens if whole else nd), True) if nd or whole else None
    if staged is not None:
        rid = step.req_id[nd:] - step.split.num_decodes
        pidx, pcnt = convert_index(rid, staged[0][1], step.topk[nd:], step.block_size, step.block_size,
                                   return_valid_counts=True)
    results = []
    for layer, (q, host, slab) in enumerate(layers):
        out, lse, l1 = _empty(q, dtype)
        if dec is not None:
            hot = apply_swaps(host, slab, dec[2]) if dec[2] is not None else slab
            n = dec[0].shape[0]
            res = sparse_prefill(q[:n], hot, dec[0], m.sm_scale, topk_length=dec[1], dtype=dtype)
            out[:n], lse[:n], l1[:n] = res.out, res.lse, res.logit_l1
        if staged is not None:
            res = sparse_prefill(q[nd:], staged[layer][0], pidx, m.sm_scale, topk_length=pcnt, dtype=dtype)
            out[nd:], lse[nd:], l1[nd:] = res.out, res.lse, res.logit_l1
        results.append(MQAResult(out, lse, l1, "bf16_hisparse"))
    return results


def _fp8(step: _Step, layers: list[tuple[Tensor, Tensor, Tensor]], dtype: torch.dtype) -> list[MQAResult]:
    """fp8_ds_mla cache, always separate (module docstring): the D decode tokens' logical top-k
    through swap_in without counts (-1 in place), the FP8 decode kernel over the slab after the
    swaps as [NG * S / B, B, 656] pages; the prefill tokens at their workspace rows, chunk by chunk
    (`_staged_chunk`)."""
    m, nd, num_tokens, bs = step.m, step.split.num_decode_tokens, step.topk.shape[0], step.block_size
    staged = [step.staged(h, g) for _, h, g in layers] if nd < num_tokens else None
    dec = step.convert(slice(0, nd), False) if nd else None
    if staged is not None:
        plan = plan_prefill(m.query_start_loc, m.seq_lens, step.split,
                            m.workspace_size or prefill_workspace_size(m.max_model_len))
        pidx, pcnt = convert_index(step.req_id, m.block_table, step.topk, bs,
                                   prefill_request_ids=plan.request_ids[:num_tokens].to(step.topk.device),
                                   prefill_workspace_starts=plan.workspace_starts.to(step.topk.device),
                                   return_valid_counts=True)
    results = []
    for layer, (q, host, slab) in enumerate(layers):
        out, lse, l1 = _empty(q, dtype)
        if dec is not None:
            hot = apply_swaps(host, slab, dec[2]) if dec[2] is not None else slab
            _, active = active_decodes(m.query_start_loc, step.split)
            q_d = reshape_query_for_spec_decode(q[:nd], active)
            pages = hot.view(-1, bs, hot.shape[-1])
            res = sparse_decode(q_d, pages, dec[0].view(active, q_d.shape[1], -1), m.sm_scale, dtype=dtype)
            out[:nd] = reshape_attn_output_for_spec_decode(res.out)
            lse[:nd] = res.lse.transpose(1, 2).reshape(nd, -1)
            l1[:nd] = res.logit_l1.transpose(1, 2).reshape(nd, -1)
        for chunk in plan.chunks if staged is not None else ():
            t = slice(*chunk.tokens)
            res = _staged_chunk(q[t], staged[layer], pidx[t], pcnt[t], step, chunk, dtype)
            out[t], lse[t], l1[t] = res.out, res.lse, res.logit_l1
        results.append(MQAResult(out, lse, l1, "fp8_separate_hisparse"))
    return results


def _staged_chunk(q: Tensor, staged: tuple[Tensor, Tensor], idx: Tensor, counts: Tensor, step: _Step,
                  chunk: PrefillChunk, dtype: torch.dtype) -> AttentionResult:
    """One prefill chunk: workspace = the chunk's requests gathered from the staged rows through the
    staged table's rows [request_start, request_start + batch) and up-converted (`gather_fp8_prefill`);
    out, lse = sparse_prefill(q, workspace, idx, topk_length = counts)."""
    rows, table = staged
    bs, first = step.block_size, chunk.requests[0] - step.split.num_decodes
    workspace = gather_upconvert_fp8(
        rows.view(-1, bs, rows.shape[-1]), table[first : first + chunk.requests[1] - chunk.requests[0]],
        torch.tensor(chunk.workspace_starts, dtype=torch.int32, device=rows.device), chunk.total_rows)
    return sparse_prefill(q, workspace, idx, step.m.sm_scale, topk_length=counts, dtype=dtype)
