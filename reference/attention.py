"""Sparse MQA attention with the FlashMLA kernels' conventions, in float64 (or float32).

For query token t, head h, with the valid entries V_t of the token's index row:
    s_j        = sm_scale * <q[t, h, :576], K_j[:576]>                j in V_t
    lse        = ln sum_j exp(s_j)                                    natural log
    max_logits = max_j s_j
    out        = sum_j exp(s_j - lse) * K_j[:512]                      V is the NoPE part of K
    with an attention sink: out *= 1 / (1 + exp(sink_h - lse))        (never changes lse)
A row with no valid entry gives out = 0, lse = +inf, max_logits = -inf. Duplicate entries count
once each. Every head reads the same K rows (MQA, one latent KV head).

With `magnitudes`, the same pass also gives the sizes an output's fp32 rounding errors grow with
(what a tolerance is derived from, as logit_l1 is for the LSE), f the sink factor (1 without one):
    out_abs    = f * sum_j p_j |K_j[:512]|        the output with every value taken by its magnitude
    value_abs  = f * sum_j |K_j[:512]|            0 on empty rows, as out

Two index forms:
  * prefill (`flash_mla_sparse_fwd`): indices are rows of a flat bf16 array `kv [N, 576]`;
    invalid = negative or >= N, and positions j >= topk_length[t] are ignored.
  * FP8 decode (`flash_mla_with_kvcache` with indices): indices are physical slots
    block * page_size + offset into a paged fp8_ds_mla cache; ONLY -1 is invalid. Anything else
    out of range is a caller bug the kernel does not check (it reads out of bounds), so the
    reference refuses it.

Memory: query tokens go through in chunks that hold at most a working budget (`streaming`: 4 GiB
by default, on a GPU never more than the process may still allocate there); the `*_chunks` forms
yield the result chunk by chunk and so hold no more than the budget whatever the number of tokens,
the others collect it.
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple

import torch

from . import streaming
from .fp8_ds_mla import HEAD_DIM, NOPE_DIM, ROW_BYTES, fp8_ds_mla_values
from .nvfp4_ds_mla import ROW_BYTES as NVFP4_ROW_BYTES, nvfp4_ds_mla_values


class AttentionResult(NamedTuple):
    out: torch.Tensor          # [..., H, 512]
    lse: torch.Tensor          # natural log; +inf on empty rows
    max_logits: torch.Tensor   # -inf on empty rows
    logit_l1: torch.Tensor     # max_j sm_scale * sum_d |q_d| |K_jd|: the size fp32 errors scale with
    out_abs: torch.Tensor | None = None    # [..., H, 512], with `magnitudes` (module docstring)
    value_abs: torch.Tensor | None = None  # [..., H, 512], with `magnitudes`


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    magnitudes: bool = False,
) -> AttentionResult:
    """The formula above for a chunk: q [c, H, 576], keys [c, k, 576] whose invalid rows are zero
    (never read: no NaN leaks), valid [c, k]. The keys are spent: once the output is out, they are
    overwritten by their magnitudes. Batched GEMMs over the gathered rows, every head of a token
    one GEMM against its rows (MQA); the one [c, H, k] logit matrix is worked on in place:
        m = max_j s_j,   p_j = exp(s_j - m) / sum_j exp(s_j - m) = exp(s_j - lse),   lse = m + ln sum."""
    logits = torch.einsum("thd,tkd->thk", q, keys).mul_(sm_scale)
    logits.masked_fill_(~valid[:, None, :], float("-inf"))
    max_logits = logits.amax(dim=-1)
    empty = max_logits == float("-inf")
    shift = max_logits.masked_fill(empty, 0)
    probs = logits.sub_(shift[..., None]).exp_()
    total = probs.sum(dim=-1)
    lse = shift + torch.log(total)
    found = [torch.einsum("thk,tkd->thd", probs.div_(total[..., None]), keys[..., :NOPE_DIM])]
    sizes = keys.abs_()  # |K|: the same memory; a zero row adds 0 to every sum below
    if magnitudes:
        found += [torch.einsum("thk,tkd->thd", probs, sizes[..., :NOPE_DIM]),
                  sizes[..., :NOPE_DIM].sum(dim=1)[:, None, :].expand_as(found[0]).clone()]
    del probs, logits
    # The tolerance's logit scale (float32 is plenty for a scale).
    l1 = torch.einsum("thd,tkd->thk", q.abs().float(), sizes.float())
    logit_l1 = (sm_scale * l1.amax(dim=-1)).to(q.dtype)
    del l1
    factor = None if attn_sink is None else 1 + torch.exp(attn_sink.to(lse.dtype)[None, :] - lse)
    for t in found:
        if factor is not None:
            t.div_(factor[..., None])
        t.masked_fill_(empty[..., None], 0)
    lse.masked_fill_(empty, float("inf"))
    return AttentionResult(found[0], lse, max_logits, logit_l1, *found[1:])


def attend_chunks(
    q: torch.Tensor,
    topk: int,
    chunk_keys: Callable[[slice], tuple[torch.Tensor, torch.Tensor]],
    build_bytes: int,
    sm_scale: float,
    attn_sink: torch.Tensor | None,
    dtype: torch.dtype,
    budget_bytes: int | None,
    magnitudes: bool = False,
) -> Iterator[tuple[slice, AttentionResult]]:
    """(rows, `attend` over q [n, H, 576][rows]) chunk by chunk (`streaming`); `chunk_keys(rows)`
    returns the chunk's keys in `dtype`, invalid entries zero, and their validity, with
    `build_bytes` of temporaries per row. Nothing is held for all n tokens at once (their int64
    indices alone would outgrow the budget at long prefills)."""
    if sm_scale <= 0:
        raise ValueError(f"sm_scale must be > 0 (the kernels take the row max before scaling), got {sm_scale}")
    n, num_heads, _ = q.shape
    chunk = streaming.tokens_per_chunk(q.device, num_heads, topk, dtype.itemsize, budget_bytes, build_bytes)
    # A plain function: bad arguments raise at the call, not at the first chunk.
    return streaming.stream(n, chunk, lambda rows: attend(q[rows].to(dtype), *chunk_keys(rows), sm_scale, attn_sink,
                                                         magnitudes))


def collect(chunks: Iterator[tuple[slice, AttentionResult]], q: torch.Tensor, dtype: torch.dtype) -> AttentionResult:
    """The whole result of `chunks` over q [n, H, 576]: out (and the magnitudes) [n, H, 512], the
    rest [n, H]."""
    n, num_heads, _ = q.shape
    whole = streaming.collect(chunks, n)
    if whole is None:  # no query token
        whole = AttentionResult(q.new_empty((n, num_heads, NOPE_DIM), dtype=dtype),
                                *(q.new_empty((n, num_heads), dtype=dtype) for _ in range(3)))
    return whole


def sparse_prefill_chunks(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    budget_bytes: int | None = None,
    magnitudes: bool = False,
) -> Iterator[tuple[slice, AttentionResult]]:
    """`sparse_prefill` one chunk of tokens at a time: (token slice, its AttentionResult)."""
    if q.dim() != 3 or q.shape[2] != HEAD_DIM or kv.dim() != 2 or kv.shape[1] != HEAD_DIM:
        raise ValueError(f"q [T, H, {HEAD_DIM}] and kv [N, {HEAD_DIM}] expected, got {tuple(q.shape)}, {tuple(kv.shape)}")
    if indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        raise ValueError(f"indices must be [T={q.shape[0]}, K], got {tuple(indices.shape)}")
    positions = torch.arange(indices.shape[1], device=indices.device)

    def chunk_keys(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        idx = indices[rows].long()
        valid = (idx >= 0) & (idx < kv.shape[0])
        if topk_length is not None:
            valid &= positions[None, :] < topk_length[rows].long()[:, None]
        keys = kv[torch.where(valid, idx, 0)]
        return keys.masked_fill_(~valid[..., None], 0).to(dtype), valid

    return attend_chunks(q, indices.shape[1], chunk_keys, 2 * HEAD_DIM + 64, sm_scale, attn_sink, dtype, budget_bytes,
                         magnitudes)


def sparse_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    budget_bytes: int | None = None,
    magnitudes: bool = False,
) -> AttentionResult:
    """`flash_mla_sparse_fwd`: q [T, H, 576], kv [N, 576], indices [T, K], topk_length [T].

    Valid entry: 0 <= indices[t, j] < N and j < topk_length[t]. Returns out [T, H, 512],
    lse / max_logits / logit_l1 [T, H] (and with `magnitudes` out_abs, value_abs [T, H, 512]),
    all in `dtype`.
    """
    chunks = sparse_prefill_chunks(q, kv, indices, sm_scale, topk_length, attn_sink, dtype=dtype, budget_bytes=budget_bytes,
                                   magnitudes=magnitudes)
    return collect(chunks, q, dtype)


def row_build_bytes(kv_cache: torch.Tensor, itemsize: int) -> int:
    """Temporary bytes per row of `cache_row_values`: the row's bytes, its slot's index
    arithmetic, for fp8 its NoPE widened to bfloat16 (on a CPU, where torch widens a mixed-dtype
    product's input into a temporary of the result's dtype, that too), and for nvfp4 its codes,
    their int32 table index and the looked-up values."""
    width = kv_cache.shape[-1] * kv_cache.element_size()
    if kv_cache.dtype == torch.uint8 and kv_cache.shape[-1] == ROW_BYTES:
        width += NOPE_DIM * (2 + (itemsize if kv_cache.device.type == "cpu" else 0))
    if kv_cache.dtype == torch.uint8 and kv_cache.shape[-1] == NVFP4_ROW_BYTES:
        width += NOPE_DIM * (2 + 4 + itemsize)
    return width + 64


def _gather(kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """kv_cache[blocks, offsets]; byte rows moved as 4-byte words where those tile them (a
    quarter of the elements to index: byte-wise, the gather was a GPU reference's costliest op)."""
    if kv_cache.dtype == torch.uint8 and kv_cache.shape[-1] % 4 == 0 and kv_cache.stride(-1) == 1 and all(
            s % 4 == 0 for s in (*kv_cache.stride()[:-1], kv_cache.storage_offset())):
        return kv_cache.view(torch.int32)[blocks, offsets].view(torch.uint8)
    return kv_cache[blocks, offsets]


def cache_row_values(kv_cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The exact values of the cache rows at physical `slots` (block * page_size + offset); a
    negative slot reads as a zero row."""
    block_size = kv_cache.shape[1]
    safe = slots.clamp(min=0)
    rows = _gather(kv_cache, safe // block_size, safe % block_size)
    rows.masked_fill_((slots < 0)[..., None], 0)  # zero bytes are a zero row in every format
    width = kv_cache.shape[-1]
    if kv_cache.dtype == torch.uint8 and width == ROW_BYTES:
        return fp8_ds_mla_values(rows, dtype)
    if kv_cache.dtype == torch.uint8 and width == NVFP4_ROW_BYTES:
        return nvfp4_ds_mla_values(rows, dtype)
    if kv_cache.dtype == torch.bfloat16 and width == HEAD_DIM:
        return rows.to(dtype)
    raise ValueError(f"unknown cache row format: {kv_cache.dtype} x {width}")


def _decode_rows(q: torch.Tensor, indices: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked decode indices as [B*S, K] (their dtype), and q as [B*S, H, 576]. The check runs
    before any result is produced, a slice of rows at a time (its masks stay within the budget)."""
    if q.dim() != 4 or q.shape[3] != HEAD_DIM or indices.dim() != 3 or indices.shape[:2] != q.shape[:2]:
        raise ValueError(f"q [B, S, H, {HEAD_DIM}] and indices [B, S, K] expected, got {tuple(q.shape)}, {tuple(indices.shape)}")
    batch, s_q, num_heads, _ = q.shape
    idx = indices.reshape(batch * s_q, indices.shape[-1])
    step = max(1, (64 << 20) // max(1, idx.shape[1]))  # 64 MiB of masks at a time
    for start in range(0, idx.shape[0], step):
        part = idx[start:start + step]
        bad = (part != -1) & ((part < 0) | (part >= capacity))
        if bool(bad.any()):
            where = tuple(bad.nonzero()[0].tolist())
            raise ValueError(
                f"decode index {int(part[where])} at {(where[0] + start, where[1])} is neither -1 nor a slot in "
                f"[0, {capacity}): the FP8 decode kernel would read out of bounds"
            )
    return idx, q.reshape(batch * s_q, num_heads, HEAD_DIM)


def sparse_decode_chunks(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    budget_bytes: int | None = None,
    magnitudes: bool = False,
) -> Iterator[tuple[slice, AttentionResult]]:
    """`sparse_decode` one chunk at a time: (slice of the B*S query rows, b-major, their
    AttentionResult with out [c, H, 512] and the rest [c, H])."""
    idx, rows_q = _decode_rows(q, indices, kv_cache.shape[0] * kv_cache.shape[1])

    def chunk_keys(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        slots = idx[rows].long()
        return cache_row_values(kv_cache, slots, dtype), slots != -1

    return attend_chunks(rows_q, idx.shape[1], chunk_keys, row_build_bytes(kv_cache, dtype.itemsize), sm_scale,
                         attn_sink, dtype, budget_bytes, magnitudes)


def sparse_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    budget_bytes: int | None = None,
    magnitudes: bool = False,
) -> AttentionResult:
    """`flash_mla_with_kvcache` sparse decode: q [B, S, H, 576], indices [B, S, K] physical slots.

    Reads any cache format by its exact meaning. Returns out [B, S, H, 512] (and with `magnitudes`
    out_abs, value_abs so laid out) and lse / max_logits / logit_l1 laid out [B, H, S], as the
    kernel lays out its lse.
    """
    chunks = sparse_decode_chunks(q, kv_cache, indices, sm_scale, attn_sink, dtype=dtype, budget_bytes=budget_bytes,
                                  magnitudes=magnitudes)
    batch, s_q, num_heads, _ = q.shape
    flat = collect(chunks, q.reshape(batch * s_q, num_heads, HEAD_DIM), dtype)

    def heads_major(x: torch.Tensor) -> torch.Tensor:
        return x.view(batch, s_q, num_heads).transpose(1, 2)

    def like_out(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.view(batch, s_q, num_heads, NOPE_DIM)

    return AttentionResult(
        like_out(flat.out), heads_major(flat.lse), heads_major(flat.max_logits), heads_major(flat.logit_l1),
        like_out(flat.out_abs), like_out(flat.value_abs),
    )


def sparse_decode_fp8(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    budget_bytes: int | None = None,
    magnitudes: bool = False,
) -> AttentionResult:
    """The public-contract decode op: `sparse_decode` on a [NB, BS, 656] uint8 fp8_ds_mla cache."""
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 3 or kv_cache.shape[2] != ROW_BYTES:
        raise ValueError(f"kv_cache must be [NB, BS, {ROW_BYTES}] uint8, got {tuple(kv_cache.shape)} {kv_cache.dtype}")
    return sparse_decode(q, kv_cache, indices, sm_scale, attn_sink, dtype=dtype, budget_bytes=budget_bytes,
                         magnitudes=magnitudes)
