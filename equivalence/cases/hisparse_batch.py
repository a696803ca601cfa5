"""A HiSparse forward_mqa batch: the plain batch's logical cache relocated into host and device
tiers (`reference.hisparse` describes the tiers and tables), for L layers sharing one top-k.

From the plain batch (`equivalence.cases.batch.make_batch`), per layer l (layer 0 is the plain batch's
cache, later layers get fresh rows in the same slots, and a fresh query):
* host cache = the plain cache, host block table = the plain block table; host block 0 (null)
  is poisoned (0xFF: NaN in bf16, e4m3 and fp32);
* a device slab of flat rows with attention block stride S = B * stride_blocks; rows of no
  block, and rows B .. S-1 of every block ("other layers"), are poisoned;
* resident pages: the last ACTIVE_TAIL_PAGES pages of every request, and each other page with
  probability `resident_frac` (1.0: every page). Their logical rows are the resident copy; the
  host copy of a resident page is stale (other finite rows), so a wrong tier shows;
* hot slots: D = `hot_slots` per request (state rows from a random injective map), in their own
  GPU blocks; a fraction `prior_hits` of slots holds, from an earlier step, host rows of the
  request's non-resident pages (with those bytes: hits), the rest are empty with stale bytes;
  the LRU order is `arange` or a random permutation (`slot_perm`);
* the plain index group's persistent buffer (`buffer_rows` rows) holds a previous step's
  conversion: valid-looking rows of the slab's poisoned and stale rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mla_verify.reference.metadata import split_decodes_and_prefills
from mla_verify.reference.paged_cache import scatter_rows

from .batch import ROW_WIDTH, Batch, make_batch
from .builders import permutation
from .params import ForwardParams
from .values import pooled_rows, q_values

ACTIVE_TAIL_PAGES = 2  # vLLM hisparse/types.py: the newest two pages are never unpinned


@dataclass
class HiSparseBatch:
    plain: Batch                       # layer 0 as the plain path sees it
    q_layers: list[torch.Tensor]       # [T, H, 576] per layer
    plain_caches: list[torch.Tensor]   # per layer, the logical cache as a plain paged cache
    host_caches: list[torch.Tensor]    # [HB, B, W] per layer
    gpu_rows: list[torch.Tensor]       # [NG * S, W] per layer
    tables: dict[str, torch.Tensor] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    # The plain index group's persistent buffers as a previous step left them (physical, counts).
    group_buffer: tuple[torch.Tensor, torch.Tensor] | None = None

    def hisparse_kwargs(self) -> dict[str, Any]:
        """Keywords of reference.forward_mqa_hisparse / optimized.hisparse.forward_mqa_hisparse."""
        b = self.plain
        return dict(query_start_loc=b.query_start_loc, seq_lens=b.seq_lens, topk_indices=b.topk_indices,
                    kv_cache_dtype=b.config["kv_cache_dtype"], sm_scale=b.config["sm_scale"],
                    max_model_len=b.config["max_model_len"], workspace_size=b.config["workspace_size"],
                    max_decode_query_len=b.config["max_decode_query_len"],
                    host_block_table=b.block_table, **self.tables, **self.config)

    def plain_kwargs(self) -> dict[str, Any]:
        return self.plain.forward_kwargs()


def _poison(t: torch.Tensor) -> torch.Tensor:
    t.view(torch.uint8).fill_(0xFF)
    return t


def make_hisparse_batch(params: ForwardParams, seed: int, device: str = "cpu") -> HiSparseBatch:
    """The plain batch of `params` (make_batch), then its HiSparse tiers from ForwardParams'
    HiSparse fields: hot_slack sets D = q_len * K + slack (-1: exactly the most rows one request
    needs)."""
    plain = make_batch(params, seed, device)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    cache_dtype, regime, rule = params.cache_dtype, params.value_regime, params.scale_rule
    bs, topk_w = params.block_size, params.topk
    table = plain.block_table
    seq_lens = plain.seq_lens
    num_req, width_blocks = table.shape
    pages = [-(-n // bs) for n in seq_lens]
    layers = params.layers

    # The logical cache of each layer: layer 0 the plain one, later layers fresh rows in its slots.
    owned = table[table > 0].long()
    slots = (owned[:, None] * bs + torch.arange(bs, device=device)).flatten()
    plain_caches = [plain.kv_cache]
    for _ in range(1, layers):
        cache = plain.kv_cache.clone()
        scatter_rows(pooled_rows(gen, len(slots), regime, cache_dtype, rule)[1], cache, slots)
        plain_caches.append(cache)
    q_layers = [plain.q] + [q_values(gen, tuple(plain.q.shape), regime, params.inputs) for _ in range(1, layers)]

    # Residency by state row.
    num_states = num_req + params.spare_state_rows
    state_rows = permutation(gen, num_states, params.inputs)[:num_req].to(torch.int32)
    frac = params.resident_frac
    resident = [[p >= n - ACTIVE_TAIL_PAGES or frac >= 1.0 or float(torch.rand((), generator=gen, device=device)) < frac
                 for p in range(n)] for n in pages]

    # Hot slots: D per request; the union of one request's non-resident valid rows bounds "exact".
    q_len = params.max_decode_query_len
    slack = topk_w if params.hot_slack is None else params.hot_slack
    split = split_decodes_and_prefills(plain.query_start_loc, q_len)
    needed = _needed_rows(plain, resident, bs, split.num_decodes)
    hot_slots = max(1, max(needed, default=1)) if slack < 0 else q_len * topk_w + slack
    hot_blocks = -(-hot_slots // bs)

    stride_rows = bs * params.stride_blocks
    num_resident = sum(map(sum, resident))
    num_gpu = 1 + num_resident + num_req * hot_blocks + 1
    gpu_ids = permutation(gen, num_gpu - 1, params.inputs) + 1
    residency = torch.zeros((num_states, width_blocks), dtype=torch.int32, device=device)
    hot_table = torch.zeros((num_req, hot_blocks), dtype=torch.int32, device=device)
    width = ROW_WIDTH[cache_dtype]
    torch_dtype = torch.bfloat16 if cache_dtype == "bfloat16" else torch.uint8
    cursor = 0
    for r in range(num_req):
        for p in range(pages[r]):
            if resident[r][p]:
                residency[int(state_rows[r]), p] = int(gpu_ids[cursor])
                cursor += 1
    for r in range(num_req):
        hot_table[r] = gpu_ids[cursor : cursor + hot_blocks].to(torch.int32)
        cursor += hot_blocks

    dgi = torch.full((num_states, hot_slots), -1, dtype=torch.int32, device=device)
    lru = torch.arange(hot_slots, device=device).repeat(num_states, 1)
    if params.slot_perm:
        lru = torch.stack([permutation(gen, hot_slots, params.inputs) for _ in range(num_states)])
    prior = params.prior_hits
    for r in range(num_req):
        host_rows = [int(table[r, p]) * bs + o for p in range(pages[r]) if not resident[r][p]
                     for o in range(min(bs, seq_lens[r] - p * bs))]
        take = min(len(host_rows), int(prior * hot_slots))
        if take:
            pick = permutation(gen, len(host_rows), params.inputs)[:take]
            where = permutation(gen, hot_slots, params.inputs)[:take]
            dgi[int(state_rows[r]), where] = torch.tensor([host_rows[i] for i in pick.tolist()], dtype=torch.int32,
                                                          device=device)

    # Slab rows of resident pages, hot slots and prior hits, shared by every layer's slab.
    res_host = [int(table[r, p]) for r in range(num_req) for p in range(pages[r]) if resident[r][p]]
    res_gpu = [int(residency[int(state_rows[r]), p]) for r in range(num_req) for p in range(pages[r]) if resident[r][p]]
    offs = torch.arange(bs, device=device)
    res_dst = (torch.tensor(res_gpu, dtype=torch.long, device=device)[:, None] * stride_rows + offs).flatten()
    slot = torch.arange(hot_slots, device=device)
    hot_rows = hot_table.long()[:, slot // bs] * stride_rows + slot % bs          # [R, D]
    held = dgi[state_rows.long()].long()                                            # [R, D]
    host_caches, gpu_rows = [], []
    for cache in plain_caches:
        host = cache.contiguous().clone()
        _poison(host[0])
        slab = _poison(torch.empty((num_gpu * stride_rows, width), dtype=torch_dtype, device=device))
        if res_host:
            ids = torch.tensor(res_host, dtype=torch.long, device=device)
            slab[res_dst] = cache[ids].reshape(-1, width)
            # Not mirrored yet: a resident page's host copy is stale.
            host[ids] = pooled_rows(gen, len(res_host) * bs, "normal", cache_dtype, rule)[1].view(len(res_host), bs, width)
        slab[hot_rows.flatten()] = pooled_rows(gen, hot_rows.numel(), "normal", cache_dtype, rule)[1]
        hit = held >= 0
        slab[hot_rows[hit]] = host.view(-1, width)[held[hit]]
        # On CUDA the host tier is pinned CPU memory, as HiSparse's source cache is.
        host_caches.append(host.cpu().pin_memory() if host.is_cuda else host)
        gpu_rows.append(slab)

    num_tokens = plain.query_start_loc[-1]
    num_decode_tokens = split.num_decode_tokens
    swap_rows = max(num_decode_tokens, 1) if params.swap_rows == "fit" else max(num_decode_tokens - 1, 0)
    buffer_rows = num_tokens + 1 if params.buffer_rows is None else params.buffer_rows
    valid_rows = torch.cat([torch.arange(g * stride_rows, (g + 1) * stride_rows, device=device) for g in range(num_gpu)])
    stale = valid_rows[torch.randint(0, len(valid_rows), (buffer_rows, topk_w), generator=gen, device=device)]
    tables = dict(residency=residency, request_state_indices=state_rows, hot_block_table=hot_table,
                  device_global_indices=dgi, lru_slots=lru)
    config = dict(attention_block_stride=stride_rows, max_swap_rows=swap_rows)
    stale_counts = torch.randint(0, topk_w + 1, (buffer_rows,), generator=gen, device=device).to(torch.int32)
    return HiSparseBatch(plain, q_layers, plain_caches, host_caches, gpu_rows, tables, config,
                         (stale.to(torch.int32), stale_counts))


def _needed_rows(plain: Batch, resident: list[list[bool]], bs: int, num_decodes: int) -> list[int]:
    """Per decode request, the distinct non-resident rows its top-k rows select."""
    qsl, topk = plain.query_start_loc, plain.topk_indices
    width = plain.block_table.shape[1]
    out = []
    for r in range(num_decodes):
        rows = topk[qsl[r] : qsl[r + 1]].flatten().tolist()
        out.append(len({i for i in rows if 0 <= i and i // bs < width and i // bs < len(resident[r])
                        and not resident[r][i // bs]}))
    return out
