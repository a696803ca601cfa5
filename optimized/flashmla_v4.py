"""FlashMLA's DeepSeek V4 / V4.1 sparse decode (`flash_mla_with_kvcache` with the V4 caches, the
`sgl-flash-mla` 1.0.0 wheel), wrapped with the checks the kernels leave out.

    sparse_decode_v4    the legacy namespace (`use_legacy=True`, kv_format "V4"): SM90 and SM100;
                        the one V4 kernel a lent H100 / H200 runs
    sparse_decode_v41   the current namespace (2026.09.30 release): SM100 only, per-token V4.1
                        pages and the FP4 extra; written against the contract and dispatched only
                        where the GPU has it

Each call builds a fresh scheduler plan: FlashMLA bakes the values of topk_length and
extra_topk_length into a plan without checking them on reuse (a stale plan splits by old
lengths). Heads are padded to 64 or 128 as serving pads them (zero q heads, -inf sinks, sliced
off after), and a list whose width is not a multiple of the kernels' 64-entry block is padded
with -1 (invalid: nothing changes), as vLLM pads its index rows; `launch_sparse_decode_v4`
hands the kernel its inputs as they are. Every check runs before `flash_mla` is imported or launched: an index other than -1
within a length is read unchecked, and misaligned rows fault in the kernel's vector loads.
"""

from __future__ import annotations

import functools

import torch

from mla_verify.optimized.adapters import flash_mla_heads, pad_heads
from mla_verify.optimized.flashmla import flash_mla_unavailable
from mla_verify.optimized.registry import FLASH_MLA, register
from mla_verify.optimized.v4_checks import V41_PAIRS, V4_PAIRS, ListArgs, check_union_decode_contract
from mla_verify.optimized.v4_formats import D_V
from mla_verify.optimized.validation import InputError

TOPK_BLOCK = 64  # both namespaces walk each list in 64-entry blocks


@functools.cache
def sm100_unavailable() -> str | None:
    """Why the current (V4.1, SM100-only) kernels cannot run here, or None."""
    why = flash_mla_unavailable()
    if why is not None:
        return why
    major, minor = torch.cuda.get_device_capability()
    if major != 10:
        return f"compute capability {major}.{minor}: FlashMLA's V4.1 kernels are SM100-only"
    return None


def _aligned(name: str, t: torch.Tensor | None, strides: tuple[int, ...], multiple: int) -> None:
    if t is None:
        return
    bad = [s for s in strides if (s * t.element_size()) % multiple]
    if t.data_ptr() % multiple or bad:
        raise InputError(f"{name}: base address and strides {strides} must be multiples of {multiple} bytes for the "
                         f"kernel's vector loads (strides {t.stride()})")


def padded_list(indices: torch.Tensor | None) -> torch.Tensor | None:
    """`indices` [B,S,K] widened with -1 to a multiple of the 64-entry block (itself if it is one)."""
    if indices is None or indices.shape[2] % TOPK_BLOCK == 0:
        return indices
    return torch.nn.functional.pad(indices, (0, -indices.shape[2] % TOPK_BLOCK), value=-1)


def check_flash_mla_limits(q, kv_cache, indices, extra_kv_cache, extra_indices) -> None:
    """FlashMLA's own limits on top of the contract: 1..128 heads (padded), 16-byte aligned pages,
    8-byte aligned index rows (read as int2), CUDA tensors."""
    heads = q.shape[2]
    if heads > 128:
        raise InputError(f"heads={heads}: FlashMLA runs 1..128 heads (padded to 64 or 128)")
    for name, cache in (("kv_cache", kv_cache), ("extra_kv_cache", extra_kv_cache)):
        _aligned(name, cache, (cache.stride(0),) if cache is not None else (), 16)
    for name, idx in (("indices", indices), ("extra_indices", extra_indices)):
        _aligned(name, idx, (idx.stride(0), idx.stride(1)) if idx is not None else (), 8)
    if flash_mla_heads(heads) == heads:  # read through TMA; a padded q is a fresh copy
        _aligned("q", q, (q.stride(0), q.stride(1), q.stride(2)), 16)
    if q.device.type != "cuda":
        raise InputError(f"FlashMLA runs on CUDA tensors, got tensors on {q.device}")


def _call(q, main: ListArgs, extra: ListArgs, sm_scale, attn_sink, **fixed):
    """flash_mla_with_kvcache with padded heads and a fresh plan -> (out [B,S,H,512], lse [B,H,S])."""
    import flash_mla

    heads = q.shape[2]
    sink = attn_sink
    if sink is not None and flash_mla_heads(heads) != heads:
        sink = torch.cat([sink, sink.new_full((flash_mla_heads(heads) - heads,), float("-inf"))])
    sched = flash_mla.get_mla_metadata()[0]
    out, lse = flash_mla.flash_mla_with_kvcache(
        pad_heads(q, 0.0), main.cache.unsqueeze(-2), None, None, D_V, sched, softmax_scale=sm_scale,
        is_fp8_kvcache=True, indices=main.indices, attn_sink=sink,
        extra_k_cache=None if extra.cache is None else extra.cache.unsqueeze(-2),
        extra_indices_in_kvcache=extra.indices, topk_length=main.length, extra_topk_length=extra.length, **fixed)
    return out[..., :heads, :], lse[:, :heads, :]


def launch_sparse_decode_v4(q, kv_cache, indices, sm_scale, topk_length=None, extra_kv_cache=None, extra_indices=None,
                            extra_topk_length=None, attn_sink=None):
    """`sparse_decode_v4` without the checks (for timing): inputs must already pass them."""
    return _call(q, ListArgs(kv_cache, indices, topk_length), ListArgs(extra_kv_cache, extra_indices, extra_topk_length),
                 sm_scale, attn_sink, use_legacy=True, kv_format="V4")


@register("sparse_decode_v4", "flash_mla", priority=FLASH_MLA, devices=("cuda",), unavailable=flash_mla_unavailable,
          deviations=("split_kv", "length_plan"))
def sparse_decode_v4(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's legacy V4 decode: (out [B,S,H,512] bf16, lse [B,H,S] f32).

    q [B,S,H,512] bf16 (H <= 128, padded to 64/128); kv_cache, extra_kv_cache [NB,BS,584] uint8
    (block-major V4 pages, 16-byte aligned blocks); indices [B,S,K], extra_indices [B,S,K2] int32
    slots (padded with -1 to multiples of 64); topk_length, extra_topk_length [B] int32; attn_sink [H] f32.
    Splits short batches over SM partitions ("split_kv"), by a plan built from the lengths' values
    ("length_plan").
    """
    main, extra = ListArgs(kv_cache, indices, topk_length), ListArgs(extra_kv_cache, extra_indices, extra_topk_length)
    sm_scale, _, _ = check_union_decode_contract(q, main, extra, sm_scale, attn_sink, V4_PAIRS)
    check_flash_mla_limits(q, kv_cache, indices, extra_kv_cache, extra_indices)
    return launch_sparse_decode_v4(q, kv_cache, padded_list(indices), sm_scale, topk_length, extra_kv_cache,
                                   padded_list(extra_indices), extra_topk_length, attn_sink)


@register("sparse_decode_v41", "flash_mla", priority=FLASH_MLA, devices=("cuda",), unavailable=sm100_unavailable,
          deviations=("split_kv", "length_plan"))
def sparse_decode_v41(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's current V4.1 decode (SM100 only; never run on the lent SM90 machines): a V4.1
    main cache [NB,BS,528] and a V4.1 or V4.1 FP4 [NB,BS,288] extra cache, per-token pages;
    otherwise as `sparse_decode_v4`."""
    main, extra = ListArgs(kv_cache, indices, topk_length), ListArgs(extra_kv_cache, extra_indices, extra_topk_length)
    sm_scale, _, _ = check_union_decode_contract(q, main, extra, sm_scale, attn_sink, V41_PAIRS)
    check_flash_mla_limits(q, kv_cache, indices, extra_kv_cache, extra_indices)
    return _call(q, main._replace(indices=padded_list(indices)), extra._replace(indices=padded_list(extra_indices)),
                 sm_scale, attn_sink, use_legacy=False)
