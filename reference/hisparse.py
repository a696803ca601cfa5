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

from .attention import sparse_decode, sparse_prefill
from .forward import MQAResult
from .indices import convert_index, req_id_per_token
from .metadata import active_decodes, plan_prefill, prefill_workspace_size, split_decodes_and_prefills
from .query import reshape_attn_output_for_spec_decode, reshape_query_for_spec_decode
from .workspace import gather_upconvert_fp8


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
    req_id: torch.Tensor, topk: torch.Tensor, *, host_block_table: torch.Tensor, residency: torch.Tensor,
    request_state_indices: torch.Tensor, hot_block_table: torch.Tensor, device_global_indices: torch.Tensor,
    lru_slots: torch.Tensor, block_size: int, stride_rows: int, return_valid_counts: bool,
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
    device, shape = topk.device, tuple(topk.shape)
    # Plain lists: the policy walks every entry, and a tensor read or op per entry cost ~0.1 s a step.
    req_id, topk, host_block_table, residency, request_state_indices, hot_block_table, device_global_indices, \
        lru_slots = (t.tolist() for t in (req_id, topk, host_block_table, residency, request_state_indices,
                                           hot_block_table, device_global_indices, lru_slots))
    bs, width = block_size, len(host_block_table[0]) if host_block_table else 0

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
    q_layers: Sequence[torch.Tensor],
    host_caches: Sequence[torch.Tensor],
    gpu_rows: Sequence[torch.Tensor],
    *,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    topk_indices: torch.Tensor,
    kv_cache_dtype: str,
    sm_scale: float,
    max_model_len: int,
    host_block_table: torch.Tensor,
    residency: torch.Tensor,
    request_state_indices: torch.Tensor,
    hot_block_table: torch.Tensor,
    device_global_indices: torch.Tensor,
    lru_slots: torch.Tensor,
    attention_block_stride: int,
    max_swap_rows: int,
    workspace_size: int | None = None,
    max_decode_query_len: int = 1,
    dtype: torch.dtype = torch.float64,
) -> list[MQAResult]:
    """Every layer of one index group on one shared top-k (module docstring): one swap-in,
    applied to each layer's own slab. Returns one MQAResult per layer."""
    bs, stride = host_caches[0].shape[1], attention_block_stride
    host_caches = [h.to(g.device) for h, g in zip(host_caches, gpu_rows)]  # pinned host memory on CUDA
    num_tokens = q_layers[0].shape[0]
    topk = topk_indices[:num_tokens]
    req_id = req_id_per_token(query_start_loc, num_tokens).to(topk_indices.device)
    # The HiSparse builder's reorder threshold is 1, raised to the spec-decode query length.
    split = split_decodes_and_prefills(query_start_loc, max_decode_query_len)
    nd, nreq = split.num_decode_tokens, split.num_decodes
    resident_all = all_context_pages_resident(seq_lens, residency, request_state_indices, bs)
    bf16 = kv_cache_dtype == "bfloat16"

    def convert(rows: slice, counts: bool) -> tuple[torch.Tensor, torch.Tensor, Swaps | None]:
        n = rows.stop - rows.start
        if n > max_swap_rows or (resident_all and nd < num_tokens):
            if not resident_all:
                raise ValueError("the resident path needs every context page resident (non-resident prefills are staged)")
            idx = convert_index(req_id[rows], residency, topk[rows], bs, stride, return_valid_counts=counts,
                                idx_mapping=request_state_indices)
            return (*idx, None) if counts else (idx, (idx >= 0).sum(1).to(torch.int32), None)
        sw = swap_in(req_id[rows], topk[rows], host_block_table=host_block_table, residency=residency,
                     request_state_indices=request_state_indices, hot_block_table=hot_block_table,
                     device_global_indices=device_global_indices, lru_slots=lru_slots, block_size=bs,
                     stride_rows=stride, return_valid_counts=counts)
        return sw.physical, sw.counts, sw

    prefill_lens = list(seq_lens[nreq:])
    staged = None
    if nd < num_tokens and not (bf16 and resident_all):
        staged = [staged_prefill_rows(h, g, prefill_block_table=host_block_table[nreq:], prefill_seq_lens=prefill_lens,
                                      residency=residency, prefill_state_rows=request_state_indices[nreq:],
                                      stride_rows=stride) for h, g in zip(host_caches, gpu_rows)]
    if bf16:
        whole = nd < num_tokens and resident_all
        dec = convert(slice(0, num_tokens if whole else nd), True) if nd or whole else None
        if nd < num_tokens and not whole:
            rid = req_id[nd:] - nreq
            pidx, pcnt = convert_index(rid, staged[0][1], topk[nd:], bs, bs, return_valid_counts=True)
    else:
        dec = convert(slice(0, nd), False) if nd else None
        if nd < num_tokens:
            plan = plan_prefill(query_start_loc, seq_lens, split, workspace_size or prefill_workspace_size(max_model_len))
            pidx, pcnt = convert_index(req_id, host_block_table, topk, bs,
                                       prefill_request_ids=plan.request_ids[:num_tokens].to(topk.device),
                                       prefill_workspace_starts=plan.workspace_starts.to(topk.device),
                                       return_valid_counts=True)

    results = []
    for layer, (q, host, slab) in enumerate(zip(q_layers, host_caches, gpu_rows)):
        out = q.new_zeros((num_tokens, q.shape[1], 512), dtype=dtype)
        lse = q.new_zeros((num_tokens, q.shape[1]), dtype=dtype)
        l1 = torch.zeros_like(lse)
        hot = apply_swaps(host, slab, dec[2]) if dec is not None and dec[2] is not None else slab
        if bf16:
            if dec is not None:
                n = dec[0].shape[0]
                res = sparse_prefill(q[:n], hot, dec[0], sm_scale, topk_length=dec[1], dtype=dtype)
                out[:n], lse[:n], l1[:n] = res.out, res.lse, res.logit_l1
            if staged is not None:
                res = sparse_prefill(q[nd:], staged[layer][0], pidx, sm_scale, topk_length=pcnt, dtype=dtype)
                out[nd:], lse[nd:], l1[nd:] = res.out, res.lse, res.logit_l1
        else:
            if dec is not None:
                _, active = active_decodes(query_start_loc, split)
                q_d = reshape_query_for_spec_decode(q[:nd], active)
                pages = hot.view(-1, bs, hot.shape[-1])
                res = sparse_decode(q_d, pages, dec[0].view(active, q_d.shape[1], -1), sm_scale, dtype=dtype)
                out[:nd] = reshape_attn_output_for_spec_decode(res.out)
                lse[:nd] = res.lse.transpose(1, 2).reshape(nd, -1)
                l1[:nd] = res.logit_l1.transpose(1, 2).reshape(nd, -1)
            for chunk in plan.chunks if staged is not None else ():
                rows, table = staged[layer]
                first = chunk.requests[0] - nreq
                workspace = gather_upconvert_fp8(
                    rows.view(-1, bs, rows.shape[-1]), table[first : first + chunk.requests[1] - chunk.requests[0]],
                    torch.tensor(chunk.workspace_starts, dtype=torch.int32, device=rows.device), chunk.total_rows)
                t = slice(*chunk.tokens)
                res = sparse_prefill(q[t], workspace, pidx[t], sm_scale, topk_length=pcnt[t], dtype=dtype)
                out[t], lse[t], l1[t] = res.out, res.lse, res.logit_l1
        results.append(MQAResult(out, lse, l1, "bf16_hisparse" if bf16 else "fp8_separate_hisparse"))
    return results
