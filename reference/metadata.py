"""The metadata builder: which tokens are decodes, which path runs, how prefills are chunked.

vLLM orders every batch decodes first, then prefills (`query_start_loc` = exclusive cumsum of the
query lengths; `seq_lens` = context + query tokens per request, what the cache holds after this
step's write). FlashMLA's builder (`FlashMLASparseMetadataBuilder`) then decides:

* the reorder threshold: the longest query that still counts as a decode (by heads and arch);
* the split: with uniform decodes required, every request whose query length equals the first
  one's (or is 0: CUDA-graph padding) before the first other one is a decode;
* the path: bf16 cache -> BF16 prefill kernel for all tokens; quantized cache with fewer than 32
  heads -> the "mixed batch" (every token through the FP8 decode kernel as one batch); otherwise
  "separate": decodes through the FP8 decode kernel, prefills through the BF16 prefill kernel over
  a BF16 workspace that is filled chunk by chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

MIN_HEADS_FOR_BF16_PREFILL = 32
# Reorder thresholds by per-rank heads: (table, default).
REORDER_THRESHOLDS = {
    "sm100": ({8: 128, 16: 128, 32: 128, 64: 256, 128: 1024}, 1024),
    "sm90": ({16: 128, 32: 128, 64: 256, 128: 256}, 256),
}
WORKSPACE_FACTOR_SHORT = 5   # sparse_mla_prefill_workspace_factor for max_model_len <= 256K
WORKSPACE_FACTOR_LONG = 2
LONG_CONTEXT = 256 * 1024


def reorder_batch_threshold(
    num_heads: int,
    arch: str = "sm90",
    *,
    max_decode_query_len: int = 1,
    dcp_size: int = 1,
    interleave: int = 1,
) -> int:
    """The longest query still treated as a decode.

    Table by heads (SM100 family vs others), raised to the spec-decode query length
    (1 + speculative tokens), and forced to 1 under DCP with interleave != 1 (varlen decodes are
    only safe with interleave 1). HiSparse (threshold 1) is out of scope here.
    """
    table, default = REORDER_THRESHOLDS[arch]
    threshold = max(table.get(num_heads, default), max_decode_query_len)
    if dcp_size > 1 and interleave != 1:
        return 1
    return threshold


@dataclass(frozen=True)
class BatchSplit:
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int


def split_decodes_and_prefills(query_start_loc: Sequence[int], threshold: int) -> BatchSplit:
    """`split_decodes_and_prefills(..., require_uniform=True)` as FlashMLA calls it.

    * every query <= threshold and threshold <= 1: all decodes;
    * the first query > threshold: all prefills;
    * otherwise a request is a prefill when its length differs from the first one's and is not 0;
      the decodes are the requests before the first prefill.
    Example: query_start_loc [0, 1, 3, 6], threshold 128 -> 1 decode (1 token), 2 prefills (5).
    """
    qsl = list(query_start_loc)
    lens = [b - a for a, b in zip(qsl, qsl[1:])]
    num_reqs, num_tokens = len(lens), qsl[-1]
    if num_reqs == 0 or (max(lens) <= threshold and threshold <= 1):
        return BatchSplit(num_reqs, 0, num_tokens, 0)
    if lens[0] > threshold:
        return BatchSplit(0, num_reqs, 0, num_tokens)
    is_prefill = [n != lens[0] and n != 0 for n in lens]
    if not any(is_prefill):
        return BatchSplit(num_reqs, 0, num_tokens, 0)
    first = is_prefill.index(True)
    return BatchSplit(first, num_reqs - first, qsl[first], num_tokens - qsl[first])


def active_decodes(query_start_loc: Sequence[int], split: BatchSplit) -> tuple[int, int]:
    """(decode_query_len, active_num_decodes): zero-length padding requests counted as decodes
    are dropped, since the FP8 decode kernel runs num_decode_tokens / decode_query_len requests.

    Example: 7 requests of 110 tokens with the 7th empty -> (110, 6).
    """
    if split.num_decodes == 0:
        return 0, 0
    decode_query_len = query_start_loc[1] - query_start_loc[0]
    if decode_query_len <= 0 or split.num_decode_tokens % decode_query_len:
        raise ValueError(
            f"decodes must be uniform: {split.num_decode_tokens} decode tokens, first query {decode_query_len}"
        )
    return decode_query_len, split.num_decode_tokens // decode_query_len


def use_mixed_batch(num_heads: int) -> bool:
    """Quantized cache with fewer than 32 heads: everything through the FP8 decode kernel, since
    the BF16 prefill kernel would pad the heads to 64 (wasteful at high tensor parallelism)."""
    return num_heads < MIN_HEADS_FOR_BF16_PREFILL


def decode_padded_heads(num_heads: int) -> int:
    """Heads the FP8 decode kernel runs: 64 or 128 (q zero-padded, results sliced back)."""
    return 64 if num_heads <= 64 else 128


def prefill_padded_heads(num_heads: int, arch: str = "sm90") -> int:
    """Heads the BF16 prefill kernel runs: a multiple of 64 (SM90) or 128 (SM100 family).

    Heads are independent, so padding never changes a real head's result.
    """
    multiple = 128 if arch == "sm100" else 64
    return -(-num_heads // multiple) * multiple


def check_dcp_supported(num_heads: int, dcp_size: int, kv_cache_dtype: str) -> None:
    """The backend's DCP guards (raise NotImplementedError, as the builder and impl do).

    DCP needs a quantized cache, the mixed-batch path (the separate path returns decode LSEs
    only), and local and gathered heads that pad to the same FP8 decode envelope
    (16 x 4 = 64 is fine; 16 x 8 = 128 and 24 x 4 = 96 are not).
    """
    if dcp_size <= 1:
        return
    if kv_cache_dtype == "bfloat16":
        raise NotImplementedError("DCP for FlashMLA sparse requires a quantized kv-cache")
    if not use_mixed_batch(num_heads):
        raise NotImplementedError(f"DCP needs the mixed-batch path (heads < {MIN_HEADS_FOR_BF16_PREFILL}), got {num_heads}")
    if decode_padded_heads(num_heads) != decode_padded_heads(num_heads * dcp_size):
        raise NotImplementedError(
            f"{num_heads} local heads pad to {decode_padded_heads(num_heads)} but "
            f"{num_heads * dcp_size} gathered heads pad to {decode_padded_heads(num_heads * dcp_size)}"
        )


def prefill_workspace_size(max_model_len: int) -> int:
    """Rows of the BF16 prefill workspace: max_model_len * factor (5 up to 256K tokens, else 2)."""
    factor = WORKSPACE_FACTOR_SHORT if max_model_len <= LONG_CONTEXT else WORKSPACE_FACTOR_LONG
    return max_model_len * factor


def split_prefill_chunks(
    seq_lens: Sequence[int], workspace_size: int, request_offset: int = 0
) -> list[tuple[int, int]]:
    """Greedy chunks of consecutive requests whose total length fits the workspace (<=).

    Examples: [2,3,4,2] / 5 -> [(0,2), (2,3), (3,4)]; [5,5,5] / 5 -> three singletons;
    [1,1,1] / 10 -> [(0,3)]. Every sequence must fit on its own.
    """
    chunks, start, total = [], 0, 0
    for i, n in enumerate(seq_lens):
        if n > workspace_size:
            raise ValueError(f"sequence {i} has {n} tokens, more than the workspace's {workspace_size}")
        if total + n > workspace_size:
            chunks.append((start + request_offset, i + request_offset))
            start, total = i, 0
        total += n
    if start < len(seq_lens):
        chunks.append((start + request_offset, len(seq_lens) + request_offset))
    return chunks


@dataclass(frozen=True)
class PrefillChunk:
    tokens: tuple[int, int]          # query rows of the chunk (decodes come first in the batch)
    requests: tuple[int, int]        # batch request indices of the chunk
    workspace_starts: list[int]      # per request, rebased so the chunk starts at workspace row 0
    total_rows: int                  # sum of the chunk's full sequence lengths


@dataclass(frozen=True)
class PrefillPlan:
    request_ids: torch.Tensor        # int32 [num_tokens]: -1 for decode tokens, else prefill index
    workspace_starts: torch.Tensor   # int32 [num_prefills]: every chunk rebased to start at 0
    chunks: list[PrefillChunk]


def plan_prefill(
    query_start_loc: Sequence[int], seq_lens: Sequence[int], split: BatchSplit, workspace_size: int
) -> PrefillPlan:
    """`_build_fp8_separate_prefill_decode`'s prefill part.

    Prefill request e (0-based among prefills) occupies workspace rows
    [workspace_starts[e], workspace_starts[e] + seq_lens[num_decodes + e]) of its chunk, holding
    its tokens 0 .. seq_len - 1. Starts are the exclusive cumsum, rebased per chunk, e.g.
    seq_lens [10, 15, 20, 5] in chunks [(0,2), (2,4)] -> [0, 10, 0, 20].
    """
    qsl, nd = list(query_start_loc), split.num_decodes
    lens = list(seq_lens[nd:])
    request_ids = torch.full((qsl[-1],), -1, dtype=torch.int32)
    for e in range(split.num_prefills):
        request_ids[qsl[nd + e] : qsl[nd + e + 1]] = e
    starts = [0] * len(lens)
    for e in range(1, len(lens)):
        starts[e] = starts[e - 1] + lens[e - 1]
    chunks = []
    for cs, ce in split_prefill_chunks(lens, workspace_size):
        base = starts[cs]
        starts[cs:ce] = [s - base for s in starts[cs:ce]]
        chunks.append(
            PrefillChunk(
                tokens=(qsl[nd + cs], qsl[nd + ce]),
                requests=(nd + cs, nd + ce),
                workspace_starts=starts[cs:ce],
                total_rows=sum(lens[cs:ce]),
            )
        )
    return PrefillPlan(request_ids, torch.tensor(starts, dtype=torch.int32), chunks)
