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
