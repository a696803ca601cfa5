"""Broken attention kernels: the reference with one defect each, returning what a kernel returns
(bf16 output, fp32 statistics)."""

import math

import torch

from mla_verify import reference
from mla_verify.reference import fp8_ds_mla as F8
from mla_verify.reference.attention import cache_row_values


def _as_kernel(res):
    return tuple(t.float().to(torch.bfloat16) if i == 0 else t.float() for i, t in enumerate(res[:3]))


def _valid(indices, rows, topk_length):
    valid = (indices >= 0) & (indices < rows)
    if topk_length is not None:
        valid &= torch.arange(indices.shape[1], device=indices.device)[None] < topk_length[:, None]
    return valid


def drops_last_valid(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """Off by one: the last valid entry of each row is skipped."""
    valid = _valid(indices, kv.shape[0], topk_length)
    pos = torch.arange(indices.shape[1], device=indices.device).expand_as(indices)
    last = torch.where(valid, pos, -1).amax(1, keepdim=True)
    spoiled = torch.where(pos == last, -1, indices)
    return _as_kernel(reference.sparse_prefill(q, kv, spoiled, sm_scale, topk_length, attn_sink))


def ignores_topk_length(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """vLLM #36616: topk_length not passed to the kernel, so entries past it count."""
    return _as_kernel(reference.sparse_prefill(q, kv, indices, sm_scale, None, attn_sink))


def empty_row_lse_minus_inf(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """The Sept-2025 convention: an empty row's LSE is -inf, not +inf."""
    out, lse, mx = _as_kernel(reference.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink))
    return out, torch.where(lse == math.inf, -math.inf, lse), mx


def lse_base_2(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """Statistics in base 2 (the old kernel / SGLang shim) where natural log is the contract."""
    out, lse, mx = _as_kernel(reference.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink))
    return out, lse * math.log2(math.e), mx * math.log2(math.e)


def deduplicates(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """Duplicate entries counted once (the kernels count each occurrence)."""
    valid = _valid(indices, kv.shape[0], topk_length)
    keyed = torch.where(valid, indices.long(), -1)
    sorted_keys, order = keyed.sort(dim=1)
    repeat = torch.zeros_like(valid)
    repeat.scatter_(1, order[:, 1:], (sorted_keys[:, 1:] == sorted_keys[:, :-1]) & (sorted_keys[:, 1:] >= 0))
    return _as_kernel(reference.sparse_prefill(q, kv, torch.where(repeat, -1, indices), sm_scale, topk_length, attn_sink))


def ignores_sink(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """The attention sink is dropped."""
    return _as_kernel(reference.sparse_prefill(q, kv, indices, sm_scale, topk_length, None))


def default_softmax_scale(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """1/sqrt(576) (FlashMLA's default) instead of the layer's scale."""
    return _as_kernel(reference.sparse_prefill(q, kv, indices, 576**-0.5, topk_length, attn_sink))


def reads_past_the_end(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """FlashMLA PR #109 class: indices >= N clamped to the last row instead of masked."""
    clamped = torch.where(indices >= kv.shape[0], kv.shape[0] - 1, indices)
    return _as_kernel(reference.sparse_prefill(q, kv, clamped, sm_scale, topk_length, attn_sink))


def decode_e8m0_scales(q, kv_cache, indices, sm_scale):
    """vLLM #49435 / FlashMLA #184: fp32 tile scales truncated to a power of two (e8m0) before use."""
    scales_at = slice(F8.SCALE_OFFSET, F8.ROPE_OFFSET)
    truncated = kv_cache.clone()
    scales = truncated[..., scales_at].contiguous().view(torch.float32)
    truncated[..., scales_at] = torch.exp2(torch.floor(torch.log2(scales))).view(torch.uint8)
    res = reference.sparse_decode_fp8(q, truncated, indices, sm_scale)
    return res.out.float().to(torch.bfloat16), res.lse.float()


def decode_ignores_rope(q, kv_cache, indices, sm_scale):
    """Logits from the 512 NoPE dims only: the 64 RoPE dims of q and the row are dropped."""
    q_nope = torch.cat([q[..., :512], torch.zeros_like(q[..., 512:])], dim=-1)
    res = reference.sparse_decode_fp8(q_nope, kv_cache, indices, sm_scale)
    return res.out.float().to(torch.bfloat16), res.lse.float()


def decode_lse_token_major(q, kv_cache, indices, sm_scale):
    """vLLM #46514 class: the decode LSE handed over as (B, S, H) values in a (B, H, S) tensor."""
    res = reference.sparse_decode_fp8(q, kv_cache, indices, sm_scale)
    lse = res.lse.transpose(1, 2).reshape(res.lse.shape)
    return res.out.float().to(torch.bfloat16), lse.float()


def index_n_is_valid(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """An off-by-one range check (`idx <= N`): index N, one past the last row, is read (as row N - 1,
    what a padded buffer would hold). Survived 100 forward_mqa examples before the boundary draws."""
    at_n = indices == kv.shape[0]
    return _as_kernel(reference.sparse_prefill(q, kv, torch.where(at_n, kv.shape[0] - 1, indices), sm_scale,
                                               topk_length, attn_sink))


def sink_in_lse(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """The sink folded into the LSE as well as the output (lse + ln(1 + e^(sink - lse))): the
    contract's LSE never includes it (a convention mix-up between attention-sink kernels)."""
    out, lse, max_logits = _as_kernel(reference.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink))
    if attn_sink is not None:
        lse = lse + torch.log1p(torch.exp(attn_sink.float()[None, :] - lse))
    return out, lse, max_logits


def assumes_dense_q(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """Reads q as if dense from the start of its storage (a kernel taking q.data_ptr() of the base
    allocation and computing its own strides): right for a contiguous q, wrong for a view."""
    dense = torch.as_strided(q, q.shape, q.contiguous().stride(), 0)
    return _as_kernel(reference.sparse_prefill(dense, kv, indices, sm_scale, topk_length, attn_sink))


def decode_scale_tiles_swapped(q, kv_cache, indices, sm_scale):
    """The output's four scale tiles applied in the wrong order (0, 1, 3, 2): the values a row
    contributes to the output take tile 3's scale for tile 2 and tile 2's for tile 3; the logits
    read the row right (the V operand's own dequantization is the one gone wrong)."""
    swapped = kv_cache.clone()
    scales = swapped[..., F8.SCALE_OFFSET:F8.ROPE_OFFSET].unflatten(-1, (4, 4))
    swapped[..., F8.SCALE_OFFSET:F8.ROPE_OFFSET] = scales[..., [0, 1, 3, 2], :].flatten(-2)
    valid = indices >= 0
    keys = cache_row_values(kv_cache, indices, torch.float64)                          # [B, S, K, 576]
    values = cache_row_values(swapped, indices, torch.float64)[..., :512]
    logits = sm_scale * torch.einsum("bshd,bskd->bshk", q.double(), keys)
    logits = logits.masked_fill(~valid[:, :, None, :], -math.inf)
    lse = torch.logsumexp(logits, dim=-1)                                              # [B, S, H]
    weights = torch.where(torch.isfinite(lse)[..., None], (logits - lse[..., None]).exp(), 0.0)
    out = torch.einsum("bshk,bskd->bshd", weights, values)
    return out.float().to(torch.bfloat16), lse.masked_fill(~torch.isfinite(lse), math.inf).transpose(1, 2).float()


def minus_one_reads_row_0(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """Invalid entries clamped into range and counted (a load with a clamped address and no mask):
    -1 and the other negatives read row 0, entries past the end the last row."""
    clamped = indices.clamp(0, kv.shape[0] - 1)
    return _as_kernel(reference.sparse_prefill(q, kv, clamped, sm_scale, topk_length, attn_sink))


def decode_minus_one_reads_slot_0(q, kv_cache, indices, sm_scale):
    """-1 entries read as slot 0 (a clamped address, no mask)."""
    res = reference.sparse_decode_fp8(q, kv_cache, indices.clamp(min=0), sm_scale)
    return res.out.float().to(torch.bfloat16), res.lse.float()


def _skip_zero_q_rows(out, lse, mx, zero):
    return out.masked_fill(zero[..., None], 0), lse.masked_fill(zero, math.inf), mx.masked_fill(zero, -math.inf)


def zero_q_row_skipped(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """A zero q row taken for a padded head and skipped as if it had no valid entry (out 0, lse
    +inf): its logits are all equal (0), the contract's answer the mean of its V rows."""
    out, lse, mx = _as_kernel(reference.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink))
    return _skip_zero_q_rows(out, lse, mx, (q == 0).all(-1))


def decode_zero_q_row_skipped(q, kv_cache, indices, sm_scale):
    """The decode kernel skipping zero q rows the same way."""
    res = reference.sparse_decode_fp8(q, kv_cache, indices, sm_scale)
    zero = (q == 0).all(-1)  # [B, S, H]; lse is [B, H, S]
    out = res.out.float().to(torch.bfloat16).masked_fill(zero[..., None], 0)
    return out, res.lse.float().masked_fill(zero.transpose(1, 2), math.inf)


# --- issue 47: what serving produces and the draws did not reach -------------------------------

def decode_spec_topk_256_reads_query_0(q, kv_cache, indices, sm_scale):
    """A dispatch table with no s_q > 1 instance at top-k 256: the s_q = 1 kernel runs, and every
    query position of a request attends with the request's first query (over its own index row).
    Right at s_q = 1 and at every other top-k: s_q > 1 and top-k 256 must be drawn together."""
    if q.shape[1] > 1 and indices.shape[-1] == 256:
        q = q[:, :1].expand_as(q)
    res = reference.sparse_decode_fp8(q, kv_cache, indices, sm_scale)
    return res.out.float().to(torch.bfloat16), res.lse.float()


def decode_s_q_rounded_up_to_pow2(q, kv_cache, indices, sm_scale):
    """Instances for s_q in 1, 2, 4 only: s_q = 3 runs the s_q = 4 instance, which reads request
    b's query rows at b * 4 + s of the flat [B * s_q] rows (the last row repeated past the end).
    Request 0 is right; every later one reads another's queries. Right at s_q 1, 2 and 4."""
    batch, s_q = q.shape[:2]
    wide = 1 << (s_q - 1).bit_length()
    if wide != s_q:
        flat = q.reshape(batch * s_q, *q.shape[2:])
        rows = (torch.arange(batch)[:, None] * wide + torch.arange(s_q)[None]).clamp(max=batch * s_q - 1)
        q = flat[rows.reshape(-1).to(q.device)].view_as(q)
    res = reference.sparse_decode_fp8(q, kv_cache, indices, sm_scale)
    return res.out.float().to(torch.bfloat16), res.lse.float()


def sink_ignored_from_64_heads(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """The instance for 64 and 128 heads (the production head counts: DeepSeek V3.2 serves 128
    heads at TP1) was built without the sink epilogue: the sink is dropped from 64 heads on."""
    return _as_kernel(reference.sparse_prefill(q, kv, indices, sm_scale, topk_length,
                                               None if q.shape[1] >= 64 else attn_sink))


INSTANTIATED_PREFILL_TOPK = (128, 256, 512, 1024, 2048)


def topk_off_the_table_rounded_down(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """A top-k dispatch table of powers of two (the SGLang / FlashInfer bucket tables: 192 and
    1152 are not in them): a top-k off the table runs the largest instance below it, which reads
    that many entries of each row and drops the rest. Right on the table."""
    k = indices.shape[1]
    bucket = max([b for b in INSTANTIATED_PREFILL_TOPK if b <= k], default=k)
    dropped = torch.arange(k, device=indices.device)[None, :] >= bucket
    return _as_kernel(reference.sparse_prefill(q, kv, torch.where(dropped, -1, indices), sm_scale, topk_length,
                                               attn_sink))


def _truncated_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16 rounded toward zero (the low 16 bits cut), as float32."""
    return (x.float().contiguous().view(torch.int32) & -65536).view(torch.float32)


def p_truncated_before_pv(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """The probabilities exp(s - max) cut to bf16 toward zero before the P.V product, the
    normalizer summed from the unrounded ones. On a peaked row the largest p is exactly 1 and the
    rest are tiny: nothing moves. On a flat row (hundreds of near-equal logits) every p sits just
    below 1 and loses up to 2^-8 of itself: the output shrinks by about 2^-9, in every row alike."""
    valid = _valid(indices, kv.shape[0], topk_length)
    rows = kv.float()[indices.long().clamp(0, kv.shape[0] - 1)]                      # [T, K, 576]
    rows = torch.where(valid[..., None], rows, 0.0)
    logits = sm_scale * torch.einsum("thd,tkd->thk", q.float(), rows)
    logits = logits.masked_fill(~valid[:, None, :], -math.inf)
    m = logits.amax(-1, keepdim=True)
    p = torch.exp(logits - torch.where(torch.isfinite(m), m, 0.0))
    total = p.sum(-1)
    out = torch.einsum("thk,tkd->thd", _truncated_to_bf16(p), rows[..., :512]) / total[..., None]
    lse = torch.log(total) + m[..., 0]
    empty = ~valid.any(1)[:, None].expand_as(lse)
    if attn_sink is not None:
        out = out * torch.sigmoid(lse - attn_sink.float()[None, :])[..., None]
    out = out.masked_fill(empty[..., None], 0.0)
    lse = lse.masked_fill(empty, math.inf)
    return out.to(torch.bfloat16), lse, m[..., 0].masked_fill(empty, -math.inf)


SPLIT_CAP = 256  # programs the split plan fills: splits per row = min(SPLIT_CAP // rows, 64-entry blocks)


def _partial(q, rows, valid, sm_scale):
    """One split of a decode row: fp32 softmax over its entries, P rounded to bf16 for P.V, the
    output normalized by its own sum (FlashMLA's split partials). (out [B,S,H,512], lse [B,S,H]) fp32."""
    logits = (sm_scale * torch.einsum("bshd,bskd->bshk", q, rows)).float()
    logits = logits.masked_fill(~valid[:, :, None, :], -math.inf)
    m = logits.amax(-1, keepdim=True)
    p = torch.exp(logits - torch.where(torch.isfinite(m), m, 0.0))
    total = p.sum(-1)
    out = torch.einsum("bshk,bskd->bshd", p.to(torch.bfloat16).float(), rows[..., :512].float()) / total[..., None]
    return out.nan_to_num(0.0), torch.log(total) + m[..., 0]


def decode_splits_by_row_count(q, kv_cache, indices, sm_scale):
    """Split-KV planned from the launch's row count (tokenspeed #904, FlashMLA #212): each row's
    top-k is split into min(256 // (B * s_q), K / 64) parts whose fp32 partials are merged, so a
    row's output depends on its batchmates by an ulp or two, and it declares no split_kv. Within
    the oracle's bounds at any batch; equal alone and in a batch while 256 // rows >= K / 64 (a
    batch of 8 at top-k 2048, of 32 at 512: every batch the invariance draws held)."""
    batch, s_q, _, _ = q.shape
    k = indices.shape[-1]
    splits = max(1, min(SPLIT_CAP // (batch * s_q), k // 64))
    rows = cache_row_values(kv_cache, indices, torch.float64)                         # [B, S, K, 576]
    valid = indices >= 0
    edges = [k * i // splits for i in range(splits + 1)]
    parts = [_partial(q.double(), rows[:, :, lo:hi], valid[:, :, lo:hi], sm_scale) for lo, hi in zip(edges, edges[1:])]
    lses = torch.stack([s for _, s in parts])                                          # [n, B, S, H]
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - torch.where(torch.isfinite(lse), lse, 0.0)).nan_to_num(0.0)
    out = (weights[..., None] * torch.stack([o for o, _ in parts])).sum(0)
    empty = ~torch.isfinite(lse)
    out = out.masked_fill(empty[..., None], 0.0)
    return out.to(torch.bfloat16), lse.masked_fill(empty, math.inf).transpose(1, 2).contiguous()


def decode_minus_ones_taken_for_the_tail(q, kv_cache, indices, sm_scale):
    """Reads a row's first K - (number of -1) entries, the -1s taken for the tail padding an
    indexer leaves: a -1 at the front or inside a row hides a valid entry from the end, and reads
    the -1 itself as slot 0. Right for rows whose -1s all trail."""
    k = indices.shape[-1]
    count = (indices >= 0).sum(-1, keepdim=True)
    spoiled = torch.where(torch.arange(k, device=indices.device) < count, indices.clamp(min=0), -1)
    res = reference.sparse_decode_fp8(q, kv_cache, spoiled, sm_scale)
    return res.out.float().to(torch.bfloat16), res.lse.float()
