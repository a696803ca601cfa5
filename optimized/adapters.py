"""Upstream kernels' native signatures, wrapped into mla-verify's contract.

mla-verify calls an implementation with the keywords of its op's contract (`mla-verify list`)
and reads the result tuple in the contract's order. FlashMLA's and vLLM's functions take other
shapes and names, and return their results in another order; passing one as it is gives
confusing metric failures, so `equivalence.subject` refuses a callable with a known upstream
signature and names the adapter here that wraps it. Each adapter has the name of the upstream
function it wraps:

    adapter                                        upstream             contract op / stage
    flash_mla_sparse_fwd(fn)                       flash_mla            sparse_prefill
    flash_mla_with_kvcache(fn, get_mla_metadata)   flash_mla            sparse_decode_fp8
    triton_convert_req_index_to_global_index(fn)   vLLM sparse_utils    convert_index
    triton_filter_and_convert_dcp_index(fn)        vLLM sparse_utils    dcp_convert_index
    correct_attn_out(fn)                           vLLM ops/dcp.py      dcp_lse_correct
    cp_lse_ag_out_rs(fn)                           vLLM ops/dcp.py      dcp_merge

An adapter does only what the serving backend does around the call: reshape, pad heads, pass
the upstream keyword names, reorder the result. It checks nothing and computes nothing, so what
the harness finds is the upstream function's behaviour. `**fixed` keywords go to every call
(e.g. `use_legacy=True` for FlashMLA's SM90 kernels). The project's own FlashMLA implementations
(`optimized/flashmla.py`) are these adapters around `flash_mla`.

This module imports only torch; `mla_verify.adapters` is its public name.
"""

from __future__ import annotations

import functools
import inspect
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

D_V = 512  # the value (output) width of the V3.2 layout, optimized.formats.D_V
COLLECTIVE_TIMEOUT_S = 300.0  # an in-process rank waits this long for the others at a collective

# ----------------------------------------------------------------------------- FlashMLA


def flash_mla_heads(heads: int) -> int:
    """The head count FlashMLA's SM90 kernels run: 64 or 128; more than 128 is left as it is."""
    return 64 if heads <= 64 else 128 if heads <= 128 else heads


def pad_heads(x: torch.Tensor, fill: float) -> torch.Tensor:
    """x with its head axis (-2) padded with `fill` to `flash_mla_heads` heads, as vLLM's backend
    pads before calling FlashMLA (zero q heads give finite junk that is sliced off; a -inf sink
    has no effect)."""
    heads = x.shape[-2]
    target = flash_mla_heads(heads)
    if target == heads:
        return x
    padded = x.new_full((*x.shape[:-2], target, x.shape[-1]), fill)
    padded[..., :heads, :] = x
    return padded


def flash_mla_sparse_fwd(fn: Callable, *, pad: bool = True, **fixed: Any) -> Callable:
    """Wrap a `flash_mla_sparse_fwd`-style prefill into the `sparse_prefill` contract.

    Upstream: fn(q [T, Hp, 576], kv [N, 1, 576], indices [T, 1, K], sm_scale, d_v=512,
    attn_sink=[Hp], topk_length=[T], **fixed) -> (out, max_logits, lse).
    Contract: (q [T, H, 576], kv [N, 576], indices [T, K], sm_scale, topk_length, attn_sink)
    -> (out [T, H, 512], lse [T, H], max_logits [T, H]).
    With `pad`, q heads are zero-padded to 64 or 128 and the sink -inf-padded, then sliced off.
    """

    def sparse_prefill(
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        sm_scale: float,
        topk_length: torch.Tensor | None = None,
        attn_sink: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        heads = q.shape[1]
        if pad:
            q = pad_heads(q, 0.0)
            if attn_sink is not None:
                attn_sink = pad_heads(attn_sink[:, None], -math.inf)[:, 0].contiguous()
        out, max_logits, lse = fn(q, kv.unsqueeze(1), indices.unsqueeze(1), sm_scale, d_v=D_V,
                                  attn_sink=attn_sink, topk_length=topk_length, **fixed)
        return out[:, :heads], lse[:, :heads], max_logits[:, :heads]

    return _adapted(sparse_prefill, fn, "flash_mla_sparse_fwd")


def flash_mla_with_kvcache(
    fn: Callable, get_mla_metadata: Callable[[], Any], *, pad: bool = True, **fixed: Any
) -> Callable:
    """Wrap a `flash_mla_with_kvcache`-style sparse FP8 decode into the `sparse_decode_fp8` contract.

    Upstream: fn(q [B, S, Hp, 576], k_cache [NB, BS, 1, 656], block_table=None,
    cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata, softmax_scale=,
    is_fp8_kvcache=True, indices=[B, S, K], **fixed) -> (out [B, S, Hp, 512], lse [B, Hp, S]).
    Contract: (q [B, S, H, 576], kv_cache [NB, BS, 656], indices [B, S, K], sm_scale) ->
    (out [B, S, H, 512], lse [B, H, S]).
    `get_mla_metadata()[0]` makes one split-KV plan per shape (batch, s_q, heads, page, top-k,
    device), filled by its first call and reused, as vLLM reuses one plan across a step's
    layers; for the V3.2 format a plan depends on those shapes only. `pad` as in
    `flash_mla_sparse_fwd`.
    """

    @functools.lru_cache(maxsize=256)
    def plan(key: tuple) -> Any:
        return get_mla_metadata()[0]

    def sparse_decode_fp8(
        q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        heads = q.shape[2]
        if pad:
            q = pad_heads(q, 0.0)
        sched = plan((*q.shape[:3], kv_cache.shape[1], indices.shape[-1], str(q.device)))
        out, lse = fn(q, kv_cache.unsqueeze(-2), None, None, D_V, sched, softmax_scale=sm_scale,
                      is_fp8_kvcache=True, indices=indices, **fixed)
        return out[..., :heads, :], lse[:, :heads, :]

    return _adapted(sparse_decode_fp8, fn, "flash_mla_with_kvcache")


# ----------------------------------------------------------------------------- vLLM index conversion


def _block_n(topk: int) -> int:
    """vLLM's kernels tile the top-k width by BLOCK_N (a power of two dividing it, 128 upstream):
    the largest such tile up to 128, so widths that are not multiples of 128 run too."""
    return min(128, topk & -topk) if topk else 128


def triton_convert_req_index_to_global_index(fn: Callable, **fixed: Any) -> Callable:
    """Wrap vLLM's `triton_convert_req_index_to_global_index` into the `convert_index` contract.

    Upstream takes `token_indices`, the block size and stride as `BLOCK_SIZE` /
    `BLOCK_STRIDE_ROWS`, the top-k width as `NUM_TOPK_TOKENS` (with a tile width `BLOCK_N` that
    divides it) and the prefill workspace behind `HAS_PREFILL_WORKSPACE`; its result is the
    contract's (indices, or (indices, valid_counts) compacted to the front). Upstream compacts
    stably while one program holds a row (K a power of two or <= 4096); past that its order within
    the prefix is unspecified, which the exact contract reports.
    """

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
        topk = topk_indices.shape[1]
        # idx_mapping only when given: upstream before HAS_IDX_MAPPING has no such keyword.
        mapping = {} if idx_mapping is None else {"idx_mapping": idx_mapping}
        return fn(req_id, block_table, topk_indices, BLOCK_SIZE=block_size, BLOCK_STRIDE_ROWS=block_stride_rows,
                  NUM_TOPK_TOKENS=topk, BLOCK_N=_block_n(topk), HAS_PREFILL_WORKSPACE=prefill_request_ids is not None,
                  prefill_workspace_request_ids=prefill_request_ids, prefill_workspace_starts=prefill_workspace_starts,
                  return_valid_counts=return_valid_counts, **mapping, **fixed)

    return _adapted(convert_index, fn, "triton_convert_req_index_to_global_index")


def triton_filter_and_convert_dcp_index(fn: Callable, **fixed: Any) -> Callable:
    """Wrap vLLM's `triton_filter_and_convert_dcp_index` into the `dcp_convert_index` contract.

    Upstream compacts with `compact_valid_to_front` when dcp_size > 1 but, at dcp_size 1, hands
    over to the plain conversion, which compacts only when asked for counts. The contract follows
    upstream as the backend calls it (no counts): no compaction at dcp_size 1.
    """

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
        topk = topk_indices.shape[1]
        result = fn(req_id, block_table, topk_indices, dcp_size, dcp_rank, cp_kv_cache_interleave_size=interleave,
                    BLOCK_SIZE=block_size, NUM_TOPK_TOKENS=topk, BLOCK_N=_block_n(topk),
                    return_valid_counts=False, compact_valid_to_front=compact_valid_to_front, **fixed)
        return result

    return _adapted(dcp_convert_index, fn, "triton_filter_and_convert_dcp_index")


# ----------------------------------------------------------------------------- vLLM DCP combine


def correct_attn_out(fn: Callable, **fixed: Any) -> Callable:
    """Wrap vLLM's `correct_attn_out(out, lses, cp_rank, ctx, is_lse_base_on_e)` into the
    `dcp_lse_correct` contract (out_r, lses, rank) -> (partial, L).

    Upstream rescales `out` in place; the adapter hands it a copy, so the caller's tensor stays
    as it was (the contract's inputs are read-only).
    """

    def dcp_lse_correct(out_r: torch.Tensor, lses: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(fn(out_r.clone(), lses, rank, None, is_lse_base_on_e=True, **fixed))

    return _adapted(dcp_lse_correct, fn, "correct_attn_out")


class _Rendezvous:
    """What the threads of one in-process group share: one slot per rank and a barrier."""

    def __init__(self, size: int):
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=COLLECTIVE_TIMEOUT_S)


class RankGroup:
    """One rank's view of an in-process group of threads, with the collectives of vLLM's
    `GroupCoordinator` that the DCP combines call (`world_size`, `rank_in_group`, `all_gather`,
    `reduce_scatter`, `all_reduce`).

    Sums are taken in float32 in rank order and rounded to the input dtype once: the contract of
    `dcp_merge`. A real NCCL reduce-scatter adds in bf16; the `dcp` op runs real collectives."""

    def __init__(self, shared: _Rendezvous, rank: int):
        self._shared, self.rank_in_group, self.world_size = shared, rank, len(shared.slots)

    def _exchange(self, t: torch.Tensor, combine: Callable[[list[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        s = self._shared
        s.slots[self.rank_in_group] = t
        s.barrier.wait()
        result = combine(list(s.slots))
        s.barrier.wait()  # every rank has read the slots before a later collective overwrites them
        return result

    @staticmethod
    def _sum(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([p.float() for p in parts]).sum(dim=0).to(parts[0].dtype)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self._exchange(input_, lambda parts: torch.cat(parts, dim=dim))

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self._exchange(input_, lambda parts: self._sum(parts).tensor_split(self.world_size, dim=dim)
                              [self.rank_in_group].contiguous())

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        return self._exchange(input_, self._sum)


def run_ranks(size: int, call: Callable[[int, RankGroup], Any]) -> list[Any]:
    """call(rank, group) on `size` threads that share one in-process group; the results in rank
    order. The first error of any rank is raised (the others are released from the barrier)."""
    shared = _Rendezvous(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = call(rank, RankGroup(shared, rank))
        except BaseException as exc:  # re-raised in the caller's thread below
            errors.append(exc)
            shared.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"mla-verify-rank{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    own = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if own:
        raise own[0]
    if errors:
        raise RuntimeError(f"the {size} ranks' collectives did not meet within {COLLECTIVE_TIMEOUT_S:g} s "
                           "(a rank called a collective the others did not)")
    return results


def cp_lse_ag_out_rs(fn: Callable, **fixed: Any) -> Callable:
    """Wrap a `cp_lse_ag_out_rs`-style combine (cp_attn_out [T, H, D], cp_attn_lse [T, H],
    cp_group, return_lse=True, is_lse_base_on_e=True) -> (out [T, H/N, D], lse [T, H/N]) into the
    `dcp_merge` contract (outs [N, T, H, D], lses [N, T, H]) -> (out [T, H, D], L [T, H]).

    The N ranks run as threads of one in-process group (`RankGroup`); rank r gets copies of
    outs[r] and lses[r] and returns its slice of the heads, which the adapter concatenates.
    Heads are padded to a multiple of N with empty rows (out 0, lse -inf), which merge to
    (0, -inf) and are sliced off. vLLM's function returns the bare output for a world of one
    rank (it is never called so), so single-rank cases fail through this adapter.
    """

    def dcp_merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ranks, _, heads, _ = outs.shape
        extra = -heads % ranks
        if extra:
            outs = torch.cat([outs, outs.new_zeros((*outs.shape[:2], extra, outs.shape[3]))], dim=2)
            lses = torch.cat([lses, lses.new_full((*lses.shape[:2], extra), -math.inf)], dim=2)

        def rank_call(rank: int, group: RankGroup):
            return fn(outs[rank].clone(), lses[rank].clone(), group, return_lse=True, is_lse_base_on_e=True, **fixed)

        parts = run_ranks(ranks, rank_call)
        out = torch.cat([o for o, _ in parts], dim=1)[:, :heads]
        lse = torch.cat([s for _, s in parts], dim=1)[:, :heads]
        return out, lse

    return _adapted(dcp_merge, fn, "cp_lse_ag_out_rs")


# ----------------------------------------------------------------------------- recognizing upstream signatures


def _adapted(wrapper: Callable, fn: Callable, adapter: str) -> Callable:
    """Name the wrapper after what it wraps and carry the wrapped function's declared deviations.
    (Not functools.wraps: `inspect.signature` would follow __wrapped__ to the upstream signature.)"""
    wrapped = getattr(fn, "__qualname__", type(fn).__name__)
    wrapper.__name__ = wrapper.__qualname__ = f"{adapter}({wrapped})"
    wrapper.__doc__ = f"{wrapped} through mla_verify.adapters.{adapter}: the {wrapper.__code__.co_name} contract."
    wrapper.__mla_verify_adapter__ = adapter
    declared = getattr(fn, "__mla_verify_deviations__", None)
    if declared is not None:
        wrapper.__mla_verify_deviations__ = declared
    return wrapper


@dataclass(frozen=True)
class NativeSignature:
    """A known upstream signature: its leading parameter names identify it."""

    adapter: str                 # the function of this module that wraps it
    upstream: str                # where it lives upstream
    op: str                      # the contract op or stage the adapter implements
    leading: tuple[str, ...]     # its first parameter names, in order
    differs: str                 # what differs from the contract, in a few words

    def hint(self, fn: Callable) -> str:
        extra = ", get_mla_metadata" if self.adapter == "flash_mla_with_kvcache" else ""
        return (f"{getattr(fn, '__qualname__', fn)} has the native signature of {self.upstream} ({self.differs}), "
                f"not the {self.op} contract: wrap it with mla_verify.adapters.{self.adapter}(fn{extra}) "
                f"(docs/reference/contracts.md, 'Adapters')")


NATIVE_SIGNATURES = (
    NativeSignature("flash_mla_sparse_fwd", "FlashMLA's flash_mla_sparse_fwd", "sparse_prefill",
                    ("q", "kv", "indices", "sm_scale", "d_v"),
                    "3-D kv and indices, returns (out, max_logits, lse)"),
    NativeSignature("flash_mla_with_kvcache", "FlashMLA's flash_mla_with_kvcache", "sparse_decode_fp8",
                    ("q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata"),
                    "4-D k_cache, a scheduler plan, softmax_scale"),
    NativeSignature("triton_convert_req_index_to_global_index", "vLLM's triton_convert_req_index_to_global_index",
                    "convert_index", ("req_id", "block_table", "token_indices", "BLOCK_SIZE", "BLOCK_STRIDE_ROWS",
                                      "NUM_TOPK_TOKENS"),
                    "token_indices, BLOCK_SIZE, NUM_TOPK_TOKENS, HAS_PREFILL_WORKSPACE"),
    NativeSignature("triton_filter_and_convert_dcp_index", "vLLM's triton_filter_and_convert_dcp_index",
                    "dcp_convert_index", ("req_id", "block_table", "token_indices", "dcp_size", "dcp_rank",
                                          "cp_kv_cache_interleave_size"),
                    "token_indices, cp_kv_cache_interleave_size, BLOCK_SIZE"),
    NativeSignature("correct_attn_out", "vLLM's correct_attn_out", "dcp_lse_correct",
                    ("out", "lses", "cp_rank", "ctx"), "cp_rank and a Triton context, rescales out in place"),
    NativeSignature("cp_lse_ag_out_rs", "vLLM's cp_lse_ag_out_rs", "dcp_merge",
                    ("cp_attn_out", "cp_attn_lse", "cp_group"), "one rank's tensors and a process group"),
)


def _parameter_names(fn: Callable) -> Sequence[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins and C extensions: nothing to inspect
        return ()
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def native_signature(fn: Callable) -> NativeSignature | None:
    """The upstream signature `fn` has, when it is one this module adapts; else None."""
    names = tuple(_parameter_names(fn))
    return next((n for n in NATIVE_SIGNATURES if names[: len(n.leading)] == n.leading), None)


__all__ = [
    "NATIVE_SIGNATURES", "NativeSignature", "RankGroup", "correct_attn_out", "cp_lse_ag_out_rs",
    "flash_mla_heads", "flash_mla_sparse_fwd", "flash_mla_with_kvcache", "native_signature", "pad_heads",
    "run_ranks", "triton_convert_req_index_to_global_index", "triton_filter_and_convert_dcp_index",
]
