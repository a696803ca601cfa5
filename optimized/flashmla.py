"""The FlashMLA kernels the backend calls (`sgl-flash-mla` 1.0.0, import `flash_mla`), wrapped with
the checks the kernels leave out; `optimized.adapters` (public as `mla_verify.adapters`) maps their
native signatures (3-D kv and indices, 4-D cache, result order) to the contract and pads the heads
as the backend does.

Every call goes to the legacy op namespace (`use_legacy=True`): the wheel's current namespace
(`torch.ops.flash_mla`) holds only the 2026.09.30 kernels, which are SM100-only and read only the
V4.1 cache formats. The SM90 kernels, and the V3.2 576-dim layout (bf16 rows for prefill, 656-byte
fp8_ds_mla rows for decode) on any architecture, live in `torch.ops.flash_mla_legacy`, so the
legacy path is the one that serves this backend on both SM90 and SM100.

All checks run before `flash_mla` is imported or a kernel launched: the decode kernel reads an
index other than -1 with no upper-bound check (an out-of-bounds read can poison the CUDA
context), and misaligned rows fault in its 16-byte loads. `flash_mla` is imported lazily so this
module imports on machines without it.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from mla_verify.optimized import adapters
from mla_verify.optimized.attention_checks import check_decode_contract, check_prefill_contract
from mla_verify.optimized.registry import FLASH_MLA, register
from mla_verify.optimized.validation import InputError, check_index_range, check_multiple, check_same_device


@functools.cache
def flash_mla_unavailable() -> str | None:
    """Why the FlashMLA kernels cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0) and major != 10:
        return f"compute capability {major}.{minor}: FlashMLA's sparse kernels need SM90 or the SM100 family"
    try:
        import flash_mla
    except Exception as exc:  # ImportError, or OSError from loading its CUDA extension
        return f"flash_mla does not import: {exc}"
    if not flash_mla.has_legacy():
        return "this flash_mla build has no legacy kernels (the SM90 / V3.2-format ones)"
    return None


def padded_heads(heads: int) -> int:
    """FlashMLA's SM90 kernels take 64 or 128 heads; fewer are padded with zero heads."""
    if heads < 1 or heads > 128:
        raise InputError(f"heads={heads}: FlashMLA runs 1..128 heads (padded to 64 or 128)")
    return adapters.flash_mla_heads(heads)


def _flash_mla(name: str) -> Callable:
    """`flash_mla.<name>`, imported at its first call."""

    def call(*args, **kwargs):
        import flash_mla

        return getattr(flash_mla, name)(*args, **kwargs)

    call.__qualname__ = f"flash_mla.{name}"
    return call


# FlashMLA's own functions through the adapters a user's FlashMLA build goes through (they pad the
# heads and map shapes and result order); the legacy namespace serves the V3.2 layout.
_native_prefill = adapters.flash_mla_sparse_fwd(_flash_mla("flash_mla_sparse_fwd"), use_legacy=True)
_native_decode = adapters.flash_mla_with_kvcache(
    _flash_mla("flash_mla_with_kvcache"), _flash_mla("get_mla_metadata"), use_legacy=True
)


def _check_aligned(name: str, t: torch.Tensor, strides: tuple[int, ...], multiple_bytes: int) -> None:
    """Base address and the given strides (in elements) must be multiples of `multiple_bytes`."""
    item = t.element_size()
    bad = [s for s in strides if (s * item) % multiple_bytes]
    if t.data_ptr() % multiple_bytes or bad:
        raise InputError(
            f"{name}: base address and strides {strides} must be multiples of {multiple_bytes} bytes "
            f"for the kernel's vector loads (address % {multiple_bytes} = {t.data_ptr() % multiple_bytes}, "
            f"strides {t.stride()})"
        )


def _check_cuda(**tensors: torch.Tensor | None) -> None:
    device = check_same_device(**tensors)
    if device.type != "cuda":
        raise InputError(f"FlashMLA runs on CUDA tensors, got tensors on {device}")


def check_prefill_inputs(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
) -> float:
    """The prefill contract plus what `flash_mla_sparse_fwd` (SM90 legacy) requires, any device."""
    sm_scale = check_prefill_contract(q, kv, indices, sm_scale, topk_length, attn_sink)
    heads, topk = q.shape[1], indices.shape[1]
    padded_heads(heads)
    check_multiple("topk", topk, 128, "the SM90 prefill kernel walks the list in pairs of 64-row blocks")
    if topk_length is not None:
        # Past topk the kernel would read the next row's indices; negative is undefined.
        check_index_range("topk_length", topk_length, topk + 1)
    # q is read through TMA (a padded q is a fresh copy), kv rows with 16-byte cp.async.
    if padded_heads(heads) == heads:
        _check_aligned("q", q, (q.stride(0), q.stride(1)), 16)
    _check_aligned("kv", kv, (kv.stride(0),), 16)
    return sm_scale


def launch_sparse_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sparse_prefill` without the checks (for timing): inputs must already pass them."""
    return _native_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)


@register("sparse_prefill", "flash_mla", priority=FLASH_MLA, devices=("cuda",), unavailable=flash_mla_unavailable,
          graph=launch_sparse_prefill)
def sparse_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA sparse prefill: (out [T,H,512] bf16, lse [T,H] f32, max_logits [T,H] f32).

    q [T,H,576] bf16 (H <= 128, padded to 64/128), kv [N,576] bf16, indices [T,K] int32 with
    K % 128 == 0 (outside [0,N) = invalid), topk_length [T] int32 in [0,K], attn_sink [H] f32.
    lse = ln sum_j e^(s_j), s_j = sm_scale <q, kv[idx_j]>; out = softmax(s) @ kv[idx, :512]
    * 1/(1+e^(sink-lse)); empty rows: out 0, lse +inf, max_logits -inf.
    """
    sm_scale = check_prefill_inputs(q, kv, indices, sm_scale, topk_length, attn_sink)
    _check_cuda(q=q, kv=kv, indices=indices, topk_length=topk_length, attn_sink=attn_sink)
    return launch_sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)


def check_decode_inputs(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float
) -> float:
    """The decode contract plus what `flash_mla_with_kvcache` (sparse FP8, SM90 legacy) requires."""
    sm_scale = check_decode_contract(q, kv_cache, indices, sm_scale)
    heads, topk = q.shape[2], indices.shape[2]
    padded_heads(heads)
    check_multiple("topk", topk, 64, "the SM90 decode kernel reads the list in 64-entry blocks")
    _check_aligned("kv_cache", kv_cache, (kv_cache.stride(0),), 16)
    _check_aligned("indices", indices, (indices.stride(0), indices.stride(1)), 8)  # read as int2
    if padded_heads(heads) == heads:  # read through TMA; a padded q is a fresh copy
        _check_aligned("q", q, (q.stride(0), q.stride(1), q.stride(2)), 16)
    return sm_scale


def launch_sparse_decode_fp8(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_decode_fp8` without the checks (for timing): inputs must already pass them."""
    return _native_decode(q, kv_cache, indices, sm_scale)


@register(
    "sparse_decode_fp8",
    "flash_mla",
    priority=FLASH_MLA,
    devices=("cuda",),
    unavailable=flash_mla_unavailable,
    deviations=("bf16_cache_scale", "bf16_dequant", "split_kv"),
    graph=launch_sparse_decode_fp8,
)
def sparse_decode_fp8(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA sparse decode over the fp8_ds_mla cache: (out [B,S,H,512] bf16, lse [B,H,S] f32).

    q [B,S,H,576] bf16 (H <= 128, padded to 64/128), kv_cache [NB,BS,656] uint8 with
    stride(1) == 656, indices [B,S,K] int32 physical slots, K % 64 == 0, each -1 or in
    [0, NB*BS). The SM90 kernel rounds each fp32 tile scale to bf16 before dequantizing
    ("bf16_cache_scale": exact for power-of-two scales), and splits a short batch's top-k lists
    over more SM partitions than a long one's ("split_kv": a request's output moves by up to 1 bf16
    ulp with the batch around it, measured on the H200).
    """
    sm_scale = check_decode_inputs(q, kv_cache, indices, sm_scale)
    _check_cuda(q=q, kv_cache=kv_cache, indices=indices)
    return launch_sparse_decode_fp8(q, kv_cache, indices, sm_scale)
