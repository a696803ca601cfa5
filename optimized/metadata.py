"""The metadata builder: which tokens are decodes, which path runs, how prefills are chunked.

What vLLM's `FlashMLASparseMetadataBuilder` (and the impl's dispatch) decides from a batch that
is ordered decodes first (`query_start_loc` = exclusive cumsum of query lengths, `seq_lens` =
context + query tokens per request):

* reorder threshold: the longest query that still counts as a decode, by per-rank heads and
  arch, raised to the spec-decode query length, forced to 1 under DCP with interleave != 1;
* split (uniform decodes required): the leading requests whose query length equals the first
  one's, or is 0 (CUDA-graph padding), are decodes; the rest are prefills;
* path: bf16 cache -> "bf16"; quantized cache with fewer than 32 heads -> "fp8_mixed";
  otherwise "fp8_separate", whose prefills run chunk by chunk over a BF16 workspace.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Sequence

import torch

from .registry import register
from .validation import InputError, check_choice

CACHE_DTYPES = ("bfloat16", "fp8_ds_mla", "nvfp4_ds_mla")
PATHS = ("bf16", "fp8_mixed", "fp8_separate")
MIN_HEADS_FOR_BF16_PREFILL = 32
# Per-rank heads -> reorder threshold, and the threshold for head counts not listed.
DECODE_THRESHOLDS = {
    "sm90": ({16: 128, 32: 128, 64: 256, 128: 256}, 256),
    "sm100": ({8: 128, 16: 128, 32: 128, 64: 256, 128: 1024}, 1024),
}
LONG_CONTEXT = 256 * 1024  # above this, the prefill workspace factor drops from 5 to 2


def reorder_batch_threshold(
    num_heads: int, arch: str = "sm90", *, max_decode_query_len: int = 1, dcp_size: int = 1, interleave: int = 1
) -> int:
    """The longest query length still treated as a decode (HiSparse, threshold 1, is out of scope)."""
    check_choice("arch", arch, tuple(DECODE_THRESHOLDS))
    if dcp_size > 1 and interleave != 1:
        return 1  # varlen decodes are only safe under DCP with interleave 1
    table, default = DECODE_THRESHOLDS[arch]
    return max(table.get(num_heads, default), max_decode_query_len)


@dataclass(frozen=True)
class BatchSplit:
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int


def _query_lens(query_start_loc: Sequence[int]) -> list[int]:
    starts = [int(x) for x in query_start_loc]
    return [end - start for start, end in zip(starts, starts[1:])]


def split_decodes_and_prefills(query_start_loc: Sequence[int], threshold: int) -> BatchSplit:
    """`split_decodes_and_prefills(require_uniform=True)`: all decodes when every query fits a
    threshold <= 1; all prefills when the first query exceeds the threshold; otherwise the decodes
    are the leading requests of the first one's length (or empty). qsl [0, 1, 3, 6] at 128 ->
    (1, 2, 1, 5)."""
    lens = _query_lens(query_start_loc)
    total = sum(lens)
    if not lens or max(lens) <= threshold <= 1:
        return BatchSplit(len(lens), 0, total, 0)
    first = lens[0]
    if first > threshold:
        return BatchSplit(0, len(lens), 0, total)
    num_decodes = next((i for i, n in enumerate(lens) if n not in (first, 0)), len(lens))
    decode_tokens = sum(lens[:num_decodes])
    return BatchSplit(num_decodes, len(lens) - num_decodes, decode_tokens, total - decode_tokens)


def active_decodes(query_start_loc: Sequence[int], split: BatchSplit) -> tuple[int, int]:
    """(decode_query_len, active_num_decodes = num_decode_tokens / decode_query_len).

    Zero-length padding requests the split counted as decodes drop out: the FP8 decode kernel
    runs one batch entry per real decode (7 requests of 110 tokens, the 7th empty -> (110, 6)).
    """
    if split.num_decodes == 0:
        return 0, 0
    lens = _query_lens(query_start_loc)
    query_len = lens[0]
    if query_len <= 0 or split.num_decode_tokens % query_len:
        raise InputError(f"decodes must be uniform: {split.num_decode_tokens} decode tokens, first query {query_len}")
    return query_len, split.num_decode_tokens // query_len


def select_path(kv_cache_dtype: str, num_heads: int) -> str:
    """bf16 cache -> "bf16"; quantized with fewer than 32 heads -> "fp8_mixed" (the BF16 prefill
    kernel would pad the heads to 64); otherwise "fp8_separate"."""
    check_choice("kv_cache_dtype", kv_cache_dtype, CACHE_DTYPES)
    if kv_cache_dtype == "bfloat16":
        return "bf16"
    return "fp8_mixed" if num_heads < MIN_HEADS_FOR_BF16_PREFILL else "fp8_separate"


def decode_padded_heads(num_heads: int) -> int:
    """Heads the FP8 decode kernel runs: 64 or 128."""
    return 64 if num_heads <= 64 else 128


def check_dcp_supported(num_heads: int, dcp_size: int, kv_cache_dtype: str) -> None:
    """The backend's DCP guards, raising NotImplementedError as the impl and builder do: DCP
    needs a quantized cache, the mixed path (the separate path returns decode LSEs only), and
    local and gathered heads padding to one FP8 decode envelope (16 x 4 ok; 16 x 8, 24 x 4 not)."""
    if dcp_size <= 1:
        return
    if kv_cache_dtype == "bfloat16":
        raise NotImplementedError("DCP for FlashMLA sparse requires a quantized kv-cache, not bfloat16")
    if num_heads >= MIN_HEADS_FOR_BF16_PREFILL:
        raise NotImplementedError(
            f"DCP for FlashMLA sparse needs the mixed-batch path (heads < {MIN_HEADS_FOR_BF16_PREFILL}), "
            f"got {num_heads}"
        )
    local, gathered = decode_padded_heads(num_heads), decode_padded_heads(num_heads * dcp_size)
    if local != gathered:
        raise NotImplementedError(
            f"{num_heads} local heads pad to {local} but {num_heads * dcp_size} DCP-gathered heads pad to {gathered}"
        )


def prefill_workspace_size(max_model_len: int) -> int:
    """Rows of the BF16 prefill workspace: max_model_len * 5, or * 2 above 256K tokens."""
    return max_model_len * (5 if max_model_len <= LONG_CONTEXT else 2)


@register("split_prefill_chunks", "python", devices=("cpu", "cuda"))
def split_prefill_chunks(seq_lens: Sequence[int], workspace_size: int) -> list[tuple[int, int]]:
    """Greedy runs of consecutive requests whose total length fits the workspace (<=):
    [2, 3, 4, 2] / 5 -> [(0, 2), (2, 3), (3, 4)]. Every sequence must fit on its own."""
    bounds: list[tuple[int, int]] = []
    start, used = 0, 0
    for i, n in enumerate(int(x) for x in seq_lens):
        if n > workspace_size:
            raise InputError(f"sequence {i} has {n} tokens, more than the {workspace_size}-row prefill workspace")
        if used + n > workspace_size:
            bounds.append((start, i))
            start, used = i, 0
        used += n
    if start < len(seq_lens):
        bounds.append((start, len(seq_lens)))
    return bounds


def req_id_per_token(query_start_loc: Sequence[int], num_tokens: int, device: torch.device | str) -> torch.Tensor:
    """int32 [num_tokens]: the request of each token; tokens past the last request map to 0."""
    lens = torch.tensor(_query_lens(query_start_loc), dtype=torch.long)
    owners = torch.repeat_interleave(torch.arange(len(lens)), lens)[:num_tokens]
    req_id = torch.zeros(num_tokens, dtype=torch.int32)
    req_id[: len(owners)] = owners
    return req_id.to(device)


def mask_empty_shards(lse: torch.Tensor, seq_lens: Sequence[int], query_start_loc: Sequence[int]) -> torch.Tensor:
    """`mask_dcp_empty_shards_`, applied before a DCP exchange: lse [..., T, H] with -inf in every
    row no request owns (rows past query_start_loc[-1]: CUDA-graph padding) and in the rows of
    requests with seq_len 0, so those rows merge to (0, -inf) on every rank. No requests: all rows."""
    live = torch.repeat_interleave(
        torch.tensor([int(n) > 0 for n in seq_lens], dtype=torch.bool),
        torch.tensor(_query_lens(query_start_loc), dtype=torch.long),
    )
    num_tokens = lse.shape[-2]
    keep = torch.zeros(num_tokens, dtype=torch.bool)
    keep[: min(num_tokens, len(live))] = live[:num_tokens]
    return lse.masked_fill(~keep[:, None].to(lse.device), float("-inf"))


@dataclass(frozen=True)
class PrefillChunk:
    tokens: slice                    # query rows of the chunk's requests
    requests: slice                  # their rows of the batch block table
    workspace_starts: torch.Tensor   # int32 view of the plan's starts: rebased, the chunk starts at row 0
    total_rows: int                  # sum of the chunk's full sequence lengths (context + query)


@dataclass(frozen=True)
class PrefillPlan:
    request_ids: torch.Tensor        # int32 [num_tokens]: -1 for decode tokens, else the prefill's index
    workspace_starts: torch.Tensor   # int32 [num_prefills]: exclusive cumsum of seq_lens, rebased per chunk
    chunks: list[PrefillChunk]


def plan_prefill(
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    split: BatchSplit,
    workspace_size: int,
    device: torch.device | str,
    split_chunks: Callable[..., list[tuple[int, int]]] = split_prefill_chunks,
) -> PrefillPlan:
    """`_build_fp8_separate_prefill_decode`'s prefill part. Prefill e (0-based after the
    decodes) holds its tokens 0 .. seq_len - 1 at workspace rows starting at workspace_starts[e]
    of its chunk: seq_lens [10, 15, 20, 5] in chunks [(0, 2), (2, 4)] -> starts [0, 10, 0, 20]."""
    first = split.num_decodes
    qsl = [int(x) for x in query_start_loc]
    lens = [int(n) for n in seq_lens[first:]]
    request_ids = torch.full((qsl[-1],), -1, dtype=torch.int32)
    request_ids[qsl[first]:] = torch.repeat_interleave(
        torch.arange(len(lens), dtype=torch.int32), torch.tensor(_query_lens(qsl[first:]), dtype=torch.long)
    )
    starts = [end - n for end, n in zip(accumulate(lens), lens)]  # exclusive cumsum
    bounds = split_chunks(seq_lens=lens, workspace_size=workspace_size)
    for lo, hi in bounds:
        base = starts[lo]
        starts[lo:hi] = [s - base for s in starts[lo:hi]]
    workspace_starts = torch.tensor(starts, dtype=torch.int32, device=device)
    chunks = [
        PrefillChunk(
            tokens=slice(qsl[first + lo], qsl[first + hi]),
            requests=slice(first + lo, first + hi),
            workspace_starts=workspace_starts[lo:hi],
            total_rows=sum(lens[lo:hi]),
        )
        for lo, hi in bounds
    ]
    return PrefillPlan(request_ids.to(device), workspace_starts, chunks)
