"""Misbehaving implementations that take a CUDA context down or hang it (GPU only; the outcome
each must get is in `tests.hostile.CUDA`). Each is correct where it does not misbehave, so the
cases between the crashes must pass, in a fresh isolation worker, and never be reported hung."""

import os

import torch
import triton
import triton.language as tl

from mla_verify.optimized import eager


def assert_on_three_tokens(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """A gather past the end of kv on cases of 3 tokens or more: torch's index kernel fails its
    device-side bounds assert, reported at the next synchronization, and the context is dead."""
    if q.shape[0] >= 3:
        past_the_end = indices.long().clamp(min=0) + kv.shape[0]
        kv[past_the_end].sum()
    return eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)


@triton.jit
def _store_far(ptr):
    tl.store(ptr + (1 << 40), 1.0)  # 4 TB past the allocation


def triton_illegal_address(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """A Triton kernel storing far out of bounds on cases of 2 tokens or more: an illegal address."""
    if q.shape[0] >= 2:
        _store_far[(1,)](torch.empty(1, device=q.device))
        torch.cuda.synchronize()
    return eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)


@triton.jit
def _spin(flag_ptr):
    i = 0
    while tl.load(flag_ptr, volatile=True) == 0:  # nothing ever sets the flag
        i += 1


def spins(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """A kernel that never finishes on cases of 2 tokens or more (a lost wake-up in a persistent kernel)."""
    if q.shape[0] >= 2:
        _spin[(1,)](torch.zeros(1, dtype=torch.int32, device=q.device))
        torch.cuda.synchronize()
    return eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)


def aborts_after_launch(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """Launches work, then aborts the process (a failed host-side check in a C++ extension)."""
    out = eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    if q.shape[0] >= 2:
        os.abort()
    return out


def corrupts_kv_cache(q, kv_cache, indices, sm_scale):
    """Right answer, then zeroes a cache row in place: the next request reads a corrupted cache."""
    result = eager.sparse_decode_fp8(q, kv_cache, indices, sm_scale)
    kv_cache[0, 0].zero_()
    return result


def returns_on_host(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """Right values, on the wrong device (copied back to the host)."""
    out, lse, max_logits = eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    return out.cpu(), lse, max_logits
