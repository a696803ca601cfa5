"""Kernels that are right when called eagerly and break inside a CUDA graph (GPU only; the outcome
each must get from property:cuda_graph is in `tests.hostile.GRAPH`). Each computes with our
compiled Triton launch, which captures cleanly: only its own misstep is graph-unsafe."""

import torch

from mla_verify.optimized.kernels.sparse_decode import launch_sparse_decode_fp8
from mla_verify.optimized.kernels.sparse_prefill import launch_sparse_prefill


def syncs_on_host(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """A host-side range check of the indices (`.item()`: a copy to the host and a sync), the kind
    the checked FlashMLA wrappers run; a stream that is capturing cannot synchronize."""
    if indices.numel() and indices.max().item() > 2**31 - 1:  # never true of int32: only the sync matters
        raise ValueError("indices out of int32 range")
    return launch_sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)


def allocates_from_host(q, kv_cache, indices, sm_scale):
    """Builds a device tensor from host values on every call (a per-request gain table made with
    `torch.tensor(list, device=...)`): a copy from pageable host memory, which capture refuses."""
    out, lse = launch_sparse_decode_fp8(q, kv_cache, indices, sm_scale)
    gain = torch.tensor([1.0] * q.shape[0], dtype=torch.bfloat16, device=q.device)  # x 1.0: the same bits
    return out * gain[:, None, None, None], lse


def reads_sizes_on_host(q, kv_cache, indices, sm_scale):
    """Sizes a workspace by the number of valid entries, read on the host (`int(tensor)` syncs)."""
    valid = int((indices != -1).sum())
    workspace = torch.empty(max(valid, 1), dtype=torch.int32, device=q.device)
    workspace.zero_()
    return launch_sparse_decode_fp8(q, kv_cache, indices, sm_scale)


_RESULTS: dict[tuple, tuple] = {}


def keeps_state(q, kv_cache, indices, sm_scale):
    """Memoizes its result by the inputs' addresses (a metadata cache keyed on data_ptr): right while
    every call brings new tensors, and in a graph, whose buffers never move, every replay returns
    what the warm-up computed."""
    key = (q.data_ptr(), kv_cache.data_ptr(), indices.data_ptr(), tuple(q.shape), tuple(indices.shape))
    if key not in _RESULTS:
        _RESULTS[key] = launch_sparse_decode_fp8(q, kv_cache, indices, sm_scale)
    return _RESULTS[key]


def writes_padding_rows(q, kv_cache, indices, sm_scale):
    """Graph-safe and right on every real row, but a row with no valid index (serving's padding in a
    padded capture) gets out 1 instead of the empty row's 0: what `padding` of a padded capture sees."""
    out, lse = launch_sparse_decode_fp8(q, kv_cache, indices, sm_scale)
    empty = (indices == -1).all(dim=-1)  # [B, S]
    return out.masked_fill(empty[..., None, None], 1.0), lse
