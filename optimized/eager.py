"""Plain float32 eager PyTorch for every tensor stage, registered as implementation "torch-fp32".

Two jobs: the portable fallback wherever no kernel runs, and the oracle's calibration subject (a
correct implementation the harness must never flag). So every function is exact on every valid
input (invalid-index forms, empty rows, duplicates, strided caches) and computes in float32:
attention errors stay around 1e-6 of the values, far inside any bf16-level bound.

Written independently of `reference/` on purpose (shared code would hide a shared bug): number
formats are decoded through 256-entry tables built from the bit fields, e4m3 rounding is done
arithmetically, bytes are assembled with shifts, workspace rows find their request with a
cumsum of markers rather than a binary search, and compaction is a cumsum-scatter.

Cache rows (little-endian):
    fp8_ds_mla    656 B  [0,512) e4m3 NoPE | [512,528) 4 x f32 tile scales | [528,656) 64 x bf16 RoPE
    nvfp4_ds_mla  352 B  [0,256) e2m1 NoPE pairs (low nibble = even element) |
                         [256,320) 64 x e4m3 RoPE | [320,352) 32 e4m3 block scales, block s at 8(s%4) + s//4
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

from . import buffers
from .registry import register
from .validation import InputError, check_choice, check_index_range, check_same_device, check_tensor

IMPL = "torch-fp32"
NOPE, ROPE, HEAD = 512, 64, 576
FP8_ROW, FP8_SCALES, FP8_ROPE, FP8_TILE = 656, 512, 528, 128
NVFP4_ROW, NVFP4_ROPE, NVFP4_SCALES, NVFP4_BLOCK = 352, 256, 320, 16
E4M3_MAX = 448.0
POW2_FLOOR = 1e-4
SCALE_RULES = ("pow2", "raw")
# Bytes a chunk of work may hold in intermediates (gathered rows, logits): bounds memory on a GPU.
BUDGET_BYTES = 256 << 20
# Intermediates of decoding one cache row: its bytes, int64 table indices, float32 values.
_DECODE_BYTES_PER_ROW = FP8_ROW + 8 * NOPE + 8 * HEAD


def _stage(stage: str):
    return register(stage, IMPL, devices=("cpu", "cuda"))


# ----------------------------------------------------------------------------- number formats


@functools.lru_cache(maxsize=None)
def _e4m3_table(device: str) -> torch.Tensor:
    """float32 value of each e4m3fn byte: (-1)^s * 2^(e-7) * (1 + m/8), subnormal 2^-6 * m/8,
    NaN for 0x7F / 0xFF (no infinities)."""
    code = torch.arange(256)
    e, m = (code >> 3) & 0xF, code & 7
    mag = torch.where(e == 0, m * 2.0**-9, (8 + m) * torch.exp2((e - 10).double()))
    mag = torch.where((code & 0x7F) == 0x7F, float("nan"), mag)
    return torch.where(code >= 128, -mag, mag).float().to(device)


@functools.lru_cache(maxsize=None)
def _e2m1_table(device: str) -> torch.Tensor:
    """float32 value of each 4-bit e2m1 code: (-1)^s * 2^(e-1) * (1 + m/2), subnormal m/2."""
    code = torch.arange(16)
    e, m = (code >> 1) & 3, code & 1
    mag = torch.where(e == 0, m * 0.5, (2 + m) * torch.exp2((e - 2).double()))
    return torch.where(code >= 8, -mag, mag).float().to(device)


def _decode(table_fn, codes: torch.Tensor) -> torch.Tensor:
    return table_fn(str(codes.device))[codes.long()]


def _e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 -> e4m3fn byte: round to nearest even on the e4m3 grid, saturating at +-448.

    Normal binade [2^k, 2^(k+1)) has spacing 2^(k-3); below 2^-6 the spacing is 2^-9. Dividing by
    a power of two is exact, so `round` (half to even) does the whole rounding.
    """
    a = x.abs().clamp(max=E4M3_MAX)
    _, ex = torch.frexp(a)  # a = f * 2^ex, f in [0.5, 1)
    spacing = torch.ldexp(torch.ones_like(a), (ex - 4).clamp(min=-9))
    r = torch.round(a / spacing) * spacing
    f, ex = torch.frexp(r)
    # Normal: biased exponent ex + 6, mantissa 16f - 8; subnormal: r / 2^-9. Codes grow with r.
    code = torch.where(r < 2.0**-6, r * 512, (ex + 6) * 8 + f * 16 - 8)
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 7)


def _le_bytes(words: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Integer words [..., n] -> their little-endian bytes [..., n * nbytes] uint8."""
    w = words.long()
    parts = [(w >> (8 * k)) & 0xFF for k in range(nbytes)]
    return torch.stack(parts, dim=-1).flatten(-2).to(torch.uint8)


def _from_le_bytes(raw: torch.Tensor, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes [..., n * nbytes] uint8 -> [..., n] words reinterpreted as `dtype` (f32 or bf16)."""
    groups = raw.long().unflatten(-1, (-1, nbytes))
    word = sum(groups[..., k] << (8 * k) for k in range(nbytes))
    bits = 8 * nbytes
    word = torch.where(word >= 2 ** (bits - 1), word - 2**bits, word)  # two's complement
    return word.to(torch.int32 if nbytes == 4 else torch.int16).view(dtype)


def _tile_scales(nope: torch.Tensor, scale_rule: str) -> torch.Tensor:
    """[N, 512] float32 -> [N, 4] float32 scales: amax / 448 (an fp32 division), then
    pow2: the smallest power of two >= max(ratio, 1e-4); raw: max(ratio, FLT_MIN)."""
    amax = nope.abs().unflatten(-1, (-1, FP8_TILE)).amax(dim=-1)
    # Divide by a tensor: CUDA kernels replace division by a Python scalar with a reciprocal multiply.
    ratio = amax / torch.full_like(amax, E4M3_MAX)
    if scale_rule == "raw":
        return ratio.clamp(min=torch.finfo(torch.float32).tiny)
    # A positive normal float rounds up to a power of two by carrying any mantissa bit into the
    # exponent: add 2^23 - 1 to the bits, then clear the mantissa.
    bits = ratio.clamp(min=POW2_FLOOR).view(torch.int32)
    return ((bits + 0x7FFFFF) & -0x800000).view(torch.float32)


def _fp8_nope(rows: torch.Tensor) -> torch.Tensor:
    """fp8_ds_mla rows [..., 656] -> float32 NoPE [..., 512]: code * tile scale (one fp32 rounding)."""
    scales = _from_le_bytes(rows[..., FP8_SCALES:FP8_ROPE], 4, torch.float32)
    return _decode(_e4m3_table, rows[..., :NOPE]) * scales.repeat_interleave(FP8_TILE, dim=-1)


def _fp8_rope(rows: torch.Tensor) -> torch.Tensor:
    """fp8_ds_mla rows -> bf16 RoPE [..., 64], bit for bit."""
    return _from_le_bytes(rows[..., FP8_ROPE:], 2, torch.bfloat16)


def _nvfp4_nope(rows: torch.Tensor) -> torch.Tensor:
    """nvfp4_ds_mla rows [..., 352] -> float32 NoPE [..., 512] (exact: e2m1 times an e4m3 scale)."""
    packed = rows[..., :NVFP4_ROPE]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    # Scale bytes as a 4 x 8 grid: byte (i, j) holds block 4j + i, so the transpose is block order.
    scale_codes = rows[..., NVFP4_SCALES:].unflatten(-1, (4, 8)).transpose(-1, -2).flatten(-2)
    scales = _decode(_e4m3_table, scale_codes).repeat_interleave(NVFP4_BLOCK, dim=-1)
    return _decode(_e2m1_table, codes) * scales


def _nvfp4_rope(rows: torch.Tensor) -> torch.Tensor:
    """nvfp4_ds_mla rows -> float32 RoPE [..., 64] (unscaled e4m3)."""
    return _decode(_e4m3_table, rows[..., NVFP4_ROPE:NVFP4_SCALES])


# Row width -> (NoPE, RoPE) readers.
ROW_FORMATS = {FP8_ROW: (_fp8_nope, _fp8_rope), NVFP4_ROW: (_nvfp4_nope, _nvfp4_rope)}


def _row_values(rows: torch.Tensor) -> torch.Tensor:
    """Quantized rows [..., W] -> their float32 values [..., 576], what attention reads."""
    nope, rope = ROW_FORMATS[rows.shape[-1]]
    return torch.cat([nope(rows), rope(rows).float()], dim=-1)


def _write_bf16(out: torch.Tensor, rows: torch.Tensor) -> None:
    """out [n, 576] bf16 <- quantized rows [n, W] as the readers up-convert them: NoPE rounded to
    bf16 from float32, RoPE exact."""
    nope, rope = ROW_FORMATS[rows.shape[-1]]
    out[:, :NOPE] = nope(rows)
    out[:, NOPE:] = rope(rows)


# ----------------------------------------------------------------------------- checks and helpers


def _check_paged_cache(kv_cache: object, width: int) -> None:
    """[NB, BS, width] uint8 whose rows are contiguous within a block (stride(0) is free)."""
    check_tensor("kv_cache", kv_cache, dtype=torch.uint8, shape=(None, None, width))
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != width:
        raise InputError(f"kv_cache: rows of a block must be contiguous, got strides {kv_cache.stride()}")


def _slot_coords(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical slots (block * BS + offset) -> (block, offset) indices into the paged cache."""
    slots = slots.long()
    return slots // kv_cache.shape[1], slots % kv_cache.shape[1]


def _chunks(n: int, bytes_per_item: int) -> Iterator[slice]:
    step = max(1, BUDGET_BYTES // max(bytes_per_item, 1))
    for start in range(0, n, step):
        yield slice(start, min(start + step, n))


@contextlib.contextmanager
def _full_fp32_matmul() -> Iterator[None]:
    """TF32 would drop 13 mantissa bits from every dot product; keep IEEE fp32 here."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


# ----------------------------------------------------------------------------- cache format


@_stage("quantize_fp8_ds_mla")
def quantize_fp8_ds_mla(kv: torch.Tensor, scale_rule: str = "pow2") -> torch.Tensor:
    """[N, 576] bf16 -> [N, 656] uint8: q_i = e4m3_RNE_sat(float32(x_i) / scale_tile(i))."""
    check_tensor("kv", kv, dtype=torch.bfloat16, shape=(None, HEAD))
    check_choice("scale_rule", scale_rule, SCALE_RULES)
    nope = kv[:, :NOPE].float()
    scales = _tile_scales(nope, scale_rule)
    codes = _e4m3_encode(nope / scales.repeat_interleave(FP8_TILE, dim=-1))
    rows = buffers.empty((kv.shape[0], FP8_ROW), torch.uint8, kv.device)
    rows[:, :NOPE] = codes
    rows[:, FP8_SCALES:FP8_ROPE] = _le_bytes(scales.view(torch.int32), 4)
    rows[:, FP8_ROPE:] = _le_bytes(kv[:, NOPE:].view(torch.int16), 2)
    return rows


@_stage("dequantize_fp8_ds_mla")
def dequantize_fp8_ds_mla(rows: torch.Tensor) -> torch.Tensor:
    """[N, 656] uint8 -> [N, 576] bf16: bf16(float32(q_i) * scale), RoPE bits copied."""
    check_tensor("rows", rows, dtype=torch.uint8, shape=(None, FP8_ROW))
    out = buffers.empty((rows.shape[0], HEAD), torch.bfloat16, rows.device)
    _write_bf16(out, rows)
    return out


@_stage("write_fp8_ds_mla_cache")
def write_fp8_ds_mla_cache(
    kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, scale_rule: str = "pow2"
) -> None:
    """cache[slot // BS, slot % BS] = quantize(kv[i]) for every slot_mapping[i] >= 0 (in place)."""
    check_tensor("kv", kv, dtype=torch.bfloat16, shape=(None, HEAD))
    _check_paged_cache(kv_cache, FP8_ROW)
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(kv.shape[0],))
    check_same_device(kv=kv, kv_cache=kv_cache, slot_mapping=slot_mapping)
    written = slot_mapping >= 0  # negative slots: tokens that are not cached (CUDA-graph padding)
    slots = slot_mapping[written]
    check_index_range("slot_mapping", slots, kv_cache.shape[0] * kv_cache.shape[1])
    kv_cache[_slot_coords(kv_cache, slots)] = quantize_fp8_ds_mla(kv[written], scale_rule)


# ----------------------------------------------------------------------------- workspace gather


def _gather_upconvert(
    kv_cache: torch.Tensor, block_table: torch.Tensor, workspace_starts: torch.Tensor, num_rows: int, width: int
) -> torch.Tensor:
    """Workspace row w <- cache row of token w - starts[r] of request r = #{i: starts[i] <= w} - 1."""
    _check_paged_cache(kv_cache, width)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    num_reqs, width_blocks = block_table.shape
    check_tensor("workspace_starts", workspace_starts, dtype=torch.int32, shape=(num_reqs,))
    check_same_device(kv_cache=kv_cache, block_table=block_table, workspace_starts=workspace_starts)
    if num_rows < 0 or (num_rows and num_reqs == 0):
        raise InputError(f"num_rows={num_rows}: need num_rows >= 0, and a request to fill any row")
    starts = workspace_starts.long()
    if num_reqs and (int(starts[0]) != 0 or bool((starts[1:] < starts[:-1]).any())):
        raise InputError(f"workspace_starts must ascend from 0, got {starts.tolist()}")
    device, block_size = kv_cache.device, kv_cache.shape[1]
    marks = torch.zeros(num_rows + 1, dtype=torch.long, device=device)
    marks.index_add_(0, starts.clamp(max=num_rows), torch.ones_like(starts))
    req = marks.cumsum(0)[:num_rows] - 1
    tok = torch.arange(num_rows, device=device) - starts[req]
    cols = tok // block_size
    if bool((cols >= width_blocks).any()):
        raise InputError(
            f"num_rows={num_rows} maps row {int((cols >= width_blocks).nonzero()[0])} past its "
            f"request's {width_blocks}-block table"
        )
    blocks = block_table.long()[req, cols]
    check_index_range("block_table (entries the chunk reads)", blocks, kv_cache.shape[0])
    out = buffers.empty((num_rows, HEAD), torch.bfloat16, device)
    for part in _chunks(num_rows, _DECODE_BYTES_PER_ROW):
        _write_bf16(out[part], kv_cache[blocks[part], tok[part] % block_size])
    return out


@_stage("gather_upconvert_fp8")
def gather_upconvert_fp8(
    kv_cache: torch.Tensor, block_table: torch.Tensor, workspace_starts: torch.Tensor, num_rows: int
) -> torch.Tensor:
    """[NB, BS, 656] fp8_ds_mla cache -> [num_rows, 576] bf16 workspace, bf16(float32(q) * scale)."""
    return _gather_upconvert(kv_cache, block_table, workspace_starts, num_rows, FP8_ROW)


@_stage("gather_upconvert_nvfp4")
def gather_upconvert_nvfp4(
    kv_cache: torch.Tensor, block_table: torch.Tensor, workspace_starts: torch.Tensor, num_rows: int
) -> torch.Tensor:
    """[NB, BS, 352] nvfp4_ds_mla cache -> [num_rows, 576] bf16 workspace (exact in bf16)."""
    return _gather_upconvert(kv_cache, block_table, workspace_starts, num_rows, NVFP4_ROW)


# ----------------------------------------------------------------------------- index conversion


def _check_conversion_inputs(req_id: object, block_table: object, topk_indices: object, block_size: int) -> None:
    check_tensor("topk_indices", topk_indices, dtype=torch.int32, ndim=2)
    # The grid is sized by req_id: a longer one wrote past the output (vLLM bug #47327).
    check_tensor("req_id", req_id, dtype=torch.int32, shape=(topk_indices.shape[0],))
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    check_same_device(req_id=req_id, block_table=block_table, topk_indices=topk_indices)
    if block_size <= 0:
        raise InputError(f"block_size must be positive, got {block_size}")
    check_index_range("req_id", req_id, block_table.shape[0])


def _through_block_table(
    req_id: torch.Tensor, block_table: torch.Tensor, pos: torch.Tensor, block_size: int, stride_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_table[r, pos // BS] * stride_rows + pos % BS, and 0 <= pos // BS < M) for pos [T, K]."""
    width_blocks = block_table.shape[1]
    cols, offsets = pos // block_size, pos % block_size
    inside = (pos >= 0) & (cols < width_blocks)
    flat = req_id.long()[:, None] * width_blocks + cols.clamp(0, max(width_blocks - 1, 0))
    blocks = block_table.reshape(-1).long()[flat] if block_table.numel() else torch.zeros_like(pos)
    return blocks * stride_rows + offsets, inside


def _place(phys: torch.Tensor, valid: torch.Tensor, compact: bool) -> torch.Tensor:
    """[T, K] rows with -1 where invalid: in place, or stably compacted (valid entries first, in
    their order) by scattering each valid entry to its running count."""
    num_tokens, topk = phys.shape
    out = buffers.empty((num_tokens, topk), torch.int32, phys.device)
    if not compact:
        out.copy_(torch.where(valid, phys, -1))
        return out
    # Invalid entries all land in a spill column past the row, which is then dropped.
    dest = torch.where(valid, valid.cumsum(dim=1) - 1, topk)
    packed = torch.full((num_tokens, topk + 1), -1, dtype=torch.long, device=phys.device)
    packed.scatter_(1, dest, torch.where(valid, phys, -1))
    out.copy_(packed[:, :topk])
    return out


@_stage("convert_index")
def convert_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    topk_indices: torch.Tensor,
    block_size: int,
    block_stride_rows: int | None = None,
    prefill_request_ids: torch.Tensor | None = None,
    prefill_workspace_starts: torch.Tensor | None = None,
    return_valid_counts: bool = False,
    idx_mapping: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Logical top-k [T, K] -> physical rows, int32, -1 where invalid.

    idx_mapping [R'] int32 (HAS_IDX_MAPPING): the table row is max(idx_mapping[req_id[t]], 0).

    tok < 0 or tok // BS >= M is invalid; decode rows: block_table[r, tok // BS] * S + tok % BS
    (S = block_stride_rows or BS); prefill rows (prefill_request_ids[t] = p >= 0):
    prefill_workspace_starts[p] + tok. With counts, rows are stably compacted.
    """
    if idx_mapping is not None:
        check_tensor("idx_mapping", idx_mapping, dtype=torch.int32, ndim=1)
        check_same_device(req_id=req_id, idx_mapping=idx_mapping)
        check_index_range("req_id", req_id, idx_mapping.shape[0])
        req_id = idx_mapping[req_id.long()].clamp(min=0)
    _check_conversion_inputs(req_id, block_table, topk_indices, block_size)
    num_tokens = topk_indices.shape[0]
    if (prefill_request_ids is None) != (prefill_workspace_starts is None):
        raise InputError("prefill_request_ids and prefill_workspace_starts come together")
    tok = topk_indices.long()
    phys, valid = _through_block_table(req_id, block_table, tok, block_size, block_stride_rows or block_size)
    if prefill_request_ids is not None:
        check_tensor("prefill_workspace_starts", prefill_workspace_starts, dtype=torch.int32, ndim=1)
        check_tensor("prefill_request_ids", prefill_request_ids, dtype=torch.int32, ndim=1)
        if prefill_request_ids.shape[0] < num_tokens:
            raise InputError(f"prefill_request_ids has {prefill_request_ids.shape[0]} rows, fewer than {num_tokens}")
        check_same_device(topk_indices=topk_indices, prefill_request_ids=prefill_request_ids,
                          prefill_workspace_starts=prefill_workspace_starts)
        ids = prefill_request_ids[:num_tokens]
        check_index_range("prefill_request_ids", ids, prefill_workspace_starts.shape[0], lower=-1)
        # Decode rows (id -1) look up an appended 0 that the final `where` discards.
        num_prefills = prefill_workspace_starts.shape[0]
        starts = torch.cat([prefill_workspace_starts.long(), prefill_workspace_starts.new_zeros(1)])
        row_start = starts[torch.where(ids >= 0, ids.long(), num_prefills)][:, None]
        phys = torch.where(ids[:, None] >= 0, row_start + tok, phys)
    out = _place(phys, valid, compact=return_valid_counts)
    if not return_valid_counts:
        return out
    counts = buffers.empty((num_tokens,), torch.int32, out.device)
    counts.copy_(valid.sum(dim=1))
    return out, counts


@_stage("dcp_convert_index")
def dcp_convert_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    topk_indices: torch.Tensor,
    block_size: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    compact_valid_to_front: bool,
) -> torch.Tensor:
    """Global top-k -> this rank's physical slots, -1 for entries another rank owns.

    Position p lies in run g = p // I; rank g % N owns it, at local position (g // N) * I + p % I,
    which converts through this rank's block table. Compacted (stably) iff compact_valid_to_front
    and dcp_size > 1: at dcp_size 1 upstream delegates to the plain converter, which ignores the flag.
    """
    _check_conversion_inputs(req_id, block_table, topk_indices, block_size)
    if dcp_size < 1 or not 0 <= dcp_rank < dcp_size or interleave < 1 or block_size % interleave:
        raise InputError(
            f"need dcp_size >= 1, 0 <= dcp_rank < dcp_size and block_size % interleave == 0; got "
            f"dcp_size={dcp_size}, dcp_rank={dcp_rank}, block_size={block_size}, interleave={interleave}"
        )
    tok = topk_indices.long()
    pos = tok.clamp(min=0)
    run = pos // interleave
    local = (run // dcp_size) * interleave + pos % interleave
    phys, inside = _through_block_table(req_id, block_table, local, block_size, block_size)
    valid = (tok >= 0) & inside & (run % dcp_size == dcp_rank)
    return _place(phys, valid, compact=compact_valid_to_front and dcp_size > 1)


# ----------------------------------------------------------------------------- attention


def _attend(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sm_scale: float, attn_sink: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [c, H, 576], keys [c, K, 576] float32 (zero where invalid), valid [c, K] ->
    out [c, H, 512] = softmax(s) @ V, lse = logsumexp(s), max_logits = max(s) over the valid
    s_j = sm_scale <q, K_j>; times sigmoid(lse - sink) with a sink; empty rows 0 / +inf / -inf."""
    masked = ~valid[:, None, :]
    with _full_fp32_matmul():
        logits = torch.bmm(q, keys.transpose(1, 2)).mul_(sm_scale).masked_fill_(masked, float("-inf"))
        probs = torch.softmax(logits, dim=-1).masked_fill_(masked, 0.0)  # empty rows: NaN -> 0
        out = torch.bmm(probs, keys[..., :NOPE])
    lse = torch.logsumexp(logits, dim=-1)
    if attn_sink is not None:
        # exp(lse) / (exp(lse) + exp(sink)): the sink is one more logit with a zero value vector.
        out *= torch.sigmoid(lse - attn_sink[None, :])[..., None]
    empty = ~valid.any(dim=1)[:, None]
    return out.masked_fill_(empty[..., None], 0.0), lse.masked_fill_(empty, float("inf")), logits.amax(dim=-1)


def _check_sm_scale(sm_scale: float) -> None:
    if not sm_scale > 0:
        raise InputError(f"sm_scale must be > 0 (the kernels take the row max before scaling), got {sm_scale}")


@register("sparse_prefill", IMPL, devices=("cpu", "cuda"), deviations=("gemm_batch",))
def sparse_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`flash_mla_sparse_fwd` over flat bf16 rows: entry j of token t is valid iff
    0 <= indices[t, j] < N and j < topk_length[t]. Returns (out bf16, lse f32, max_logits f32)."""
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, HEAD), last_dim_contiguous=True)
    num_tokens, num_heads, _ = q.shape
    check_tensor("kv", kv, dtype=torch.bfloat16, shape=(None, HEAD), last_dim_contiguous=True)
    check_tensor("indices", indices, dtype=torch.int32, shape=(num_tokens, None))
    topk = indices.shape[1]
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtype=torch.int32, shape=(num_tokens,))
        check_index_range("topk_length", topk_length, topk + 1)  # longer would read past the row
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtype=torch.float32, shape=(num_heads,))
    check_same_device(q=q, kv=kv, indices=indices, topk_length=topk_length, attn_sink=attn_sink)
    _check_sm_scale(sm_scale)

    idx = indices.long()
    valid = (idx >= 0) & (idx < kv.shape[0])
    if topk_length is not None:
        valid &= torch.arange(topk, device=q.device)[None, :] < topk_length[:, None]
    out = buffers.empty((num_tokens, num_heads, NOPE), torch.bfloat16, q.device)
    lse = buffers.empty((num_tokens, num_heads), torch.float32, q.device)
    max_logits = buffers.empty((num_tokens, num_heads), torch.float32, q.device)
    for part in _chunks(num_tokens, topk * (HEAD * 4 + num_heads * 12)):
        v = valid[part]
        keys = torch.zeros((*v.shape, HEAD), dtype=torch.float32, device=q.device)
        keys[v] = kv[idx[part][v]].float()  # only valid rows are read: others may hold NaN
        o, l, m = _attend(q[part].float(), keys, v, sm_scale, attn_sink)
        out[part], lse[part], max_logits[part] = o, l, m
    return out, lse, max_logits


def _sparse_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 decode kernel's contract on a paged quantized cache: indices are physical slots,
    only -1 is invalid. Returns out [B, S, H, 512] bf16 and lse [B, H, S] f32 (a transposed view
    of a [B, S, H] buffer, as the kernel returns it)."""
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, None, HEAD), last_dim_contiguous=True)
    batch, s_q, num_heads, _ = q.shape
    _check_paged_cache(kv_cache, width)
    check_tensor("indices", indices, dtype=torch.int32, shape=(batch, s_q, None))
    check_same_device(q=q, kv_cache=kv_cache, indices=indices)
    _check_sm_scale(sm_scale)
    # The kernel checks nothing: any other out-of-range slot is an out-of-bounds read.
    check_index_range("indices", indices, kv_cache.shape[0] * kv_cache.shape[1], sentinels=(-1,))

    rows = batch * s_q
    topk = indices.shape[2]
    idx = indices.reshape(rows, topk)
    valid = idx != -1
    q_rows = q.reshape(rows, num_heads, HEAD)
    out = buffers.empty((batch, s_q, num_heads, NOPE), torch.bfloat16, q.device)
    lse = buffers.empty((batch, s_q, num_heads), torch.float32, q.device)
    out_rows, lse_rows = out.view(rows, num_heads, NOPE), lse.view(rows, num_heads)
    for part in _chunks(rows, topk * (_DECODE_BYTES_PER_ROW + num_heads * 12)):
        v = valid[part]
        keys = torch.zeros((*v.shape, HEAD), dtype=torch.float32, device=q.device)
        keys[v] = _row_values(kv_cache[_slot_coords(kv_cache, idx[part][v])])
        o, l, _ = _attend(q_rows[part].float(), keys, v, sm_scale, None)
        out_rows[part], lse_rows[part] = o, l
    return out, lse.transpose(1, 2)


@register("sparse_decode_fp8", IMPL, devices=("cpu", "cuda"), deviations=("gemm_batch",))
def sparse_decode_fp8(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`flash_mla_with_kvcache` sparse decode on a [NB, BS, 656] fp8_ds_mla cache:
    q [B, S, H, 576], indices [B, S, K] -> (out [B, S, H, 512] bf16, lse [B, H, S] f32)."""
    return _sparse_decode(q, kv_cache, indices, sm_scale, FP8_ROW)


@_stage("sparse_decode_nvfp4")
def sparse_decode_nvfp4(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same decode on a [NB, BS, 352] nvfp4_ds_mla cache (SM100's FP4 decode)."""
    return _sparse_decode(q, kv_cache, indices, sm_scale, NVFP4_ROW)


# ----------------------------------------------------------------------------- query and DCP


@_stage("concat_mla_q")
def concat_mla_q(ql_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """[T, H, 512] and [T, H, 64] bf16 -> [T, H, 576] bf16: NoPE then RoPE."""
    check_tensor("ql_nope", ql_nope, dtype=torch.bfloat16, shape=(None, None, NOPE), last_dim_contiguous=True)
    check_tensor("q_pe", q_pe, dtype=torch.bfloat16, shape=(ql_nope.shape[0], ql_nope.shape[1], ROPE),
                 last_dim_contiguous=True)
    check_same_device(ql_nope=ql_nope, q_pe=q_pe)
    q = buffers.empty((*ql_nope.shape[:2], HEAD), torch.bfloat16, ql_nope.device)
    q[..., :NOPE] = ql_nope
    q[..., NOPE:] = q_pe
    return q


def _merge_weights(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lses [N, T, H] -> (L [T, H], f [N, T, H]) of the LSE merge: L = logsumexp_n x_n with
    x = lse where NaN / +inf become -inf (-inf where every rank is empty); f_n = exp(lse_n - L),
    0 where that exponent is NaN or +inf."""
    inf = float("inf")
    merged = torch.logsumexp(lses.masked_fill(torch.isnan(lses) | (lses == inf), -inf), dim=0)
    exponent = lses - merged
    return merged, torch.exp(exponent).masked_fill_(torch.isnan(exponent) | (exponent == inf), 0.0)


def _scaled_terms(outs: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """bf16(f * out), as each rank stores its term before the reduce-scatter; exactly 0 where
    f = 0, which drops whatever junk (NaN, inf) an empty rank's output holds."""
    terms = (outs.float() * f[..., None]).to(torch.bfloat16)
    return terms.masked_fill_(f[..., None] == 0, 0.0)


@_stage("dcp_lse_correct")
def dcp_lse_correct(out_r: torch.Tensor, lses: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's share of the AG+RS combine (`correct_attn_out`): out_r [T, H, D] bf16 and every
    rank's lses [N, T, H] f32 -> (bf16(f_rank * out_r) [T, H, D], L [T, H] f32)."""
    check_tensor("lses", lses, dtype=torch.float32, ndim=3)
    check_tensor("out_r", out_r, dtype=torch.bfloat16, shape=(*lses.shape[1:], None))
    check_same_device(out_r=out_r, lses=lses)
    if not 0 <= rank < lses.shape[0]:
        raise InputError(f"rank={rank} is outside [0, {lses.shape[0]}) (lses has {lses.shape[0]} ranks)")
    merged, f = _merge_weights(lses)
    partial = buffers.empty(tuple(out_r.shape), torch.bfloat16, out_r.device)
    lse = buffers.empty(tuple(merged.shape), torch.float32, out_r.device)
    partial.copy_(_scaled_terms(out_r, f[rank]))
    lse.copy_(merged)
    return partial, lse


@_stage("dcp_merge")
def dcp_merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's `dcp_lse_correct` share, summed (in float32) and rounded to bf16:
    outs [N, T, H, D] bf16, lses [N, T, H] f32 -> (out [T, H, D] bf16, L [T, H] f32)."""
    check_tensor("lses", lses, dtype=torch.float32, ndim=3)
    check_tensor("outs", outs, dtype=torch.bfloat16, shape=(*lses.shape, None))
    check_same_device(outs=outs, lses=lses)
    merged, f = _merge_weights(lses)
    out = buffers.empty(tuple(outs.shape[1:]), torch.bfloat16, outs.device)
    lse = buffers.empty(tuple(merged.shape), torch.float32, outs.device)
    out.copy_(_scaled_terms(outs, f).float().sum(dim=0))
    lse.copy_(merged)
    return out, lse


@_stage("dcp_a2a_merge")
def dcp_a2a_merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The all-to-all combine's merge (`dcp_a2a_lse_reduce` after the exchange), for the heads
    one rank received from every rank: outs [N, T, H, D] bf16, lses [N, T, H] f32 ->
    (bf16(sum_n w_n * out_n) [T, H, D], L [T, H] f32), w_n = exp(lse_n - L) as in `dcp_merge`
    (0 for -inf, +inf and NaN LSEs, and the partial dropped there), summed in float32 and rounded
    once: unlike the reduce-scatter, no term is stored in bf16 first."""
    check_tensor("lses", lses, dtype=torch.float32, ndim=3)
    check_tensor("outs", outs, dtype=torch.bfloat16, shape=(*lses.shape, None))
    check_same_device(outs=outs, lses=lses)
    merged, w = _merge_weights(lses)
    out = buffers.empty(tuple(outs.shape[1:]), torch.bfloat16, outs.device)
    lse = buffers.empty(tuple(merged.shape), torch.float32, outs.device)
    terms = (outs.float() * w[..., None]).masked_fill_(w[..., None] == 0, 0.0)
    out.copy_(terms.sum(dim=0))
    lse.copy_(merged)
    return out, lse
