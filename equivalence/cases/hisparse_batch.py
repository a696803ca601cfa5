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
from typing import Any, TypeVar

import torch

from mla_verify.reference.metadata import split_decodes_and_prefills
from mla_verify.reference.paged_cache import scatter_rows

from .batch import ROW_WIDTH, Batch, make_batch
from .builders import permutation
from .params import ForwardParams
from .values import pooled_rows, q_values

T = TypeVar("T")
ACTIVE_TAIL_PAGES = 2  # vLLM hisparse/types.py: the newest two pages are never unpinned


@dataclass
class HiSparseBatch:
    plain: Batch                       # layer 0 as the plain path sees it
    q_layers: list[torch.Tensor]       # [T, H, 576] per layer
    plain_caches: list[torch.Tensor]   # per layer, the logical cache as a plain paged cache
    host_caches: list[torch.Tensor]    # [HB, B, W] per layer
    gpu_rows: list[torch.Tensor]       # [NG * S, W] per layer
    tables: dict[str, torch.Tensor] = field(default_factory=dict)  # the tensors of HiSparseTables
    config: dict[str, Any] = field(default_factory=dict)          # its attention_block_stride, max_swap_rows
    # The plain index group's persistent buffers as a previous step left them (physical, counts).
    group_buffer: tuple[torch.Tensor, torch.Tensor] | None = None

    def hisparse_tables(self, kind: type[T]) -> T:
        """The tiers' tables as `kind` spells them (`reference.HiSparseTables` or
        `optimized.hisparse.HiSparseTables`); the metadata is the plain batch's (`Batch.metadata`),
        its block table the host block table."""
        return kind(**self.tables, **self.config)


def _poison(t: torch.Tensor) -> torch.Tensor:
    t.view(torch.uint8).fill_(0xFF)
    return t


def make_hisparse_batch(params: ForwardParams, seed: int, device: str = "cpu") -> HiSparseBatch:
    """The plain batch of `params` (make_batch), then its HiSparse tiers from ForwardParams'
    HiSparse fields: hot_slack sets D = q_len * K + slack (-1: exactly the most rows one request
    needs). The steps below draw from one generator, in this order."""
    plain = make_batch(params, seed, device)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    plain_caches, q_layers = _layers(plain, params, gen)
    state_rows, resident = _residency(plain, params, gen)
    # Hot slots: D per request; the union of one request's non-resident valid rows bounds "exact".
    q_len, topk_w = params.max_decode_query_len, params.topk
    slack = topk_w if params.hot_slack is None else params.hot_slack
    split = split_decodes_and_prefills(plain.query_start_loc, q_len)
    needed = _needed_rows(plain, resident, params.block_size, split.num_decodes)
    hot_slots = max(1, max(needed, default=1)) if slack < 0 else q_len * topk_w + slack
    blocks = _gpu_blocks(plain, params, gen, state_rows, resident, hot_slots)
    dgi, lru = _hot_slots(plain, params, gen, state_rows, resident, hot_slots)
    host_caches, gpu_rows = _tiers(plain, plain_caches, params, gen, blocks, state_rows, resident, dgi)

    num_tokens, num_decode_tokens = plain.query_start_loc[-1], split.num_decode_tokens
    swap_rows = max(num_decode_tokens, 1) if params.swap_rows == "fit" else max(num_decode_tokens - 1, 0)
    buffer_rows = num_tokens + 1 if params.buffer_rows is None else params.buffer_rows
    stride_rows = blocks.stride_rows
    valid_rows = torch.cat([torch.arange(g * stride_rows, (g + 1) * stride_rows, device=device)
                            for g in range(blocks.num_gpu)])
    stale = valid_rows[torch.randint(0, len(valid_rows), (buffer_rows, topk_w), generator=gen, device=device)]
    tables = dict(residency=blocks.residency, request_state_indices=state_rows, hot_block_table=blocks.hot_table,
                  device_global_indices=dgi, lru_slots=lru)
    config = dict(attention_block_stride=stride_rows, max_swap_rows=swap_rows)
    stale_counts = torch.randint(0, topk_w + 1, (buffer_rows,), generator=gen, device=device).to(torch.int32)
    return HiSparseBatch(plain, q_layers, plain_caches, host_caches, gpu_rows, tables, config,
                         (stale.to(torch.int32), stale_counts))


def _layers(plain: Batch, params: ForwardParams, gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The logical cache and the query of each layer: layer 0 the plain ones, later layers fresh
    rows in the same slots and a fresh query."""
    bs, table, device = params.block_size, plain.block_table, plain.block_table.device
    owned = table[table > 0].long()
    slots = (owned[:, None] * bs + torch.arange(bs, device=device)).flatten()
    plain_caches = [plain.kv_cache]
    for _ in range(1, params.layers):
        cache = plain.kv_cache.clone()
        scatter_rows(pooled_rows(gen, len(slots), params.value_regime, params.cache_dtype, params.scale_rule)[1],
                     cache, slots)
        plain_caches.append(cache)
    q_layers = [plain.q] + [q_values(gen, tuple(plain.q.shape), params.value_regime, params.inputs)
                            for _ in range(1, params.layers)]
    return plain_caches, q_layers


def _residency(plain: Batch, params: ForwardParams, gen: torch.Generator) -> tuple[torch.Tensor, list[list[bool]]]:
    """(the state row of each request, which of its pages are resident): the newest
    ACTIVE_TAIL_PAGES always, each other page with probability `resident_frac`."""
    device, num_req = plain.block_table.device, plain.block_table.shape[0]
    state_rows = permutation(gen, num_req + params.spare_state_rows, params.inputs)[:num_req].to(torch.int32)
    frac = params.resident_frac
    pages = [-(-n // params.block_size) for n in plain.seq_lens]
    resident = [[p >= n - ACTIVE_TAIL_PAGES or frac >= 1.0 or float(torch.rand((), generator=gen, device=device)) < frac
                 for p in range(n)] for n in pages]
    return state_rows, resident


@dataclass(frozen=True)
class _Blocks:
    """The device slab's GPU blocks: block 0 and the last unused, the rest resident pages and hot blocks."""

    residency: torch.Tensor   # [max_seqs, M] state row -> GPU block of each page, 0 = not resident
    hot_table: torch.Tensor   # [R, ceil(D / B)] GPU blocks of each request's hot slots
    num_gpu: int
    stride_rows: int          # S = B * stride_blocks


def _gpu_blocks(plain: Batch, params: ForwardParams, gen: torch.Generator, state_rows: torch.Tensor,
                resident: list[list[bool]], hot_slots: int) -> _Blocks:
    """Resident pages, then each request's hot blocks, at randomly permuted GPU blocks."""
    bs, (num_req, width_blocks), device = params.block_size, plain.block_table.shape, plain.block_table.device
    hot_blocks = -(-hot_slots // bs)
    num_gpu = 1 + sum(map(sum, resident)) + num_req * hot_blocks + 1
    gpu_ids = permutation(gen, num_gpu - 1, params.inputs) + 1
    residency = torch.zeros((len(state_rows) + params.spare_state_rows, width_blocks), dtype=torch.int32,
                            device=device)
    hot_table = torch.zeros((num_req, hot_blocks), dtype=torch.int32, device=device)
    cursor = 0
    for r in range(num_req):
        for p, here in enumerate(resident[r]):
            if here:
                residency[int(state_rows[r]), p] = int(gpu_ids[cursor])
                cursor += 1
    for r in range(num_req):
        hot_table[r] = gpu_ids[cursor : cursor + hot_blocks].to(torch.int32)
        cursor += hot_blocks
    return _Blocks(residency, hot_table, num_gpu, bs * params.stride_blocks)


def _hot_slots(plain: Batch, params: ForwardParams, gen: torch.Generator, state_rows: torch.Tensor,
               resident: list[list[bool]], hot_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(device_global_indices, lru_slots) by state row: a fraction `prior_hits` of each request's
    slots holds, from an earlier step, host rows of its non-resident pages; the LRU order is
    `arange` or a random permutation (`slot_perm`)."""
    bs, table, device = params.block_size, plain.block_table, plain.block_table.device
    num_states = len(state_rows) + params.spare_state_rows
    dgi = torch.full((num_states, hot_slots), -1, dtype=torch.int32, device=device)
    lru = torch.arange(hot_slots, device=device).repeat(num_states, 1)
    if params.slot_perm:
        lru = torch.stack([permutation(gen, hot_slots, params.inputs) for _ in range(num_states)])
    for r, seq_len in enumerate(plain.seq_lens):
        host_rows = [int(table[r, p]) * bs + o for p in range(len(resident[r])) if not resident[r][p]
                     for o in range(min(bs, seq_len - p * bs))]
        take = min(len(host_rows), int(params.prior_hits * hot_slots))
        if take:
            pick = permutation(gen, len(host_rows), params.inputs)[:take]
            where = permutation(gen, hot_slots, params.inputs)[:take]
            dgi[int(state_rows[r]), where] = torch.tensor([host_rows[i] for i in pick.tolist()], dtype=torch.int32,
                                                          device=device)
    return dgi, lru


def _tiers(plain: Batch, plain_caches: list[torch.Tensor], params: ForwardParams, gen: torch.Generator,
           blocks: _Blocks, state_rows: torch.Tensor, resident: list[list[bool]], dgi: torch.Tensor
           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's host cache and device slab: resident pages copied into the slab (their host
    copy then stale), hot slots stale rows but for the prior hits' host rows, the rest poisoned."""
    cache_dtype, rule, bs, stride_rows = params.cache_dtype, params.scale_rule, params.block_size, blocks.stride_rows
    device, width = plain.block_table.device, ROW_WIDTH[cache_dtype]
    torch_dtype = torch.bfloat16 if cache_dtype == "bfloat16" else torch.uint8
    pages = [(r, p) for r, here in enumerate(resident) for p in range(len(here)) if here[p]]
    res_host = [int(plain.block_table[r, p]) for r, p in pages]
    res_gpu = [int(blocks.residency[int(state_rows[r]), p]) for r, p in pages]
    offs = torch.arange(bs, device=device)
    res_dst = (torch.tensor(res_gpu, dtype=torch.long, device=device)[:, None] * stride_rows + offs).flatten()
    slot = torch.arange(dgi.shape[1], device=device)
    hot_rows = blocks.hot_table.long()[:, slot // bs] * stride_rows + slot % bs     # [R, D]
    held = dgi[state_rows.long()].long()                                            # [R, D]
    host_caches, gpu_rows = [], []
    for cache in plain_caches:
        host = cache.contiguous().clone()
        _poison(host[0])
        slab = _poison(torch.empty((blocks.num_gpu * stride_rows, width), dtype=torch_dtype, device=device))
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
    return host_caches, gpu_rows


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
