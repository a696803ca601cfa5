"""Where the backend changes path, and on which side of each boundary a forward_mqa batch falls.

The seed backend routes a batch by thresholds a fuzz draw must cross, each both ways
(/work/shared/spec/vllm_backend.md sections 6-7):

    fp8_path     a quantized cache with H < 32 heads runs every token through the FP8 decode
                 kernel as one batch (mixed); H >= 32 splits decodes from BF16 prefills (separate)
    decode_topk  the FP8 decode kernel reads top-k lists in 64-entry blocks: a list of an odd
                 number of them (K % 128 == 64) ends on a half of the prefill kernel's 128 unit
    split        the uniform split (`require_uniform_decodes`): all decodes (a uniform batch,
                 CUDA-graph padding requests of length 0 among them), all prefills (the first
                 query past the reorder threshold), or decodes then prefills, where a short query
                 of another length is a prefill and one as long as the decodes is a decode
    chunks       the separate path's prefills in chunks of the BF16 workspace (greedy, <=): one,
                 two, or several
    dcp_empty    under DCP a rank whose shard of a request is empty (a sequence shorter than
                 dcp_size * interleave tokens): its rows are neutralized to the merge's identity

`sides(params)` names the side of each boundary a batch's params (forward_mqa's, as drawn) fall
on; `scripts/routing_table.py` counts them over drawn batches (the table of docs/scope.md).
"""

from __future__ import annotations

from typing import Any, Mapping

from mla_verify.reference.indices import dcp_local_seq_lens
from mla_verify.reference.metadata import (
    active_decodes,
    prefill_workspace_size,
    reorder_batch_threshold,
    split_decodes_and_prefills,
    split_prefill_chunks,
    use_mixed_batch,
)

# Each boundary's sides, in the table's order; "-" where a batch does not meet the boundary.
SIDES: dict[str, tuple[str, ...]] = {
    "fp8_path": ("mixed (H < 32)", "separate (H >= 32)"),
    "decode_topk": ("K % 128 == 64", "K % 128 == 0"),
    "split": ("all decodes", "with padding requests", "all prefills", "decodes + prefills",
              "a short prefill (<= threshold)", "a prefill as long as the decodes"),
    "chunks": ("1 chunk", "2 chunks", ">= 3 chunks"),
    "dcp_empty": ("a rank empty for a request", "every rank holds every request"),
}


def _query_start_loc(query_lens: list[int]) -> list[int]:
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return qsl


def sides(params: Mapping[str, Any]) -> dict[str, list[str]]:
    """Boundary -> the sides the batch of `params` (a forward_mqa case's params) is on: several
    for `split` (a batch may hold padding requests and a short prefill), none where it does not
    meet the boundary (no FP8 decode call, no separate-path prefill, no DCP)."""
    heads, lens, ctx = params["heads"], list(params["query_lens"]), list(params["context_lens"])
    fp8 = params["cache_dtype"] != "bfloat16"
    mixed = fp8 and use_mixed_batch(heads)
    dcp, interleave = params.get("dcp_size", 1), params.get("interleave", 1)
    qsl = _query_start_loc(lens)
    threshold = reorder_batch_threshold(heads, params.get("arch", "sm90"),
                                        max_decode_query_len=params.get("max_decode_query_len", 1),
                                        dcp_size=dcp, interleave=interleave)
    split = split_decodes_and_prefills(qsl, threshold)
    found: dict[str, list[str]] = {name: [] for name in SIDES}
    if fp8:
        found["fp8_path"].append(SIDES["fp8_path"][0 if mixed else 1])
        # Mixed: every MQA token through the decode kernel; separate: the decodes only.
        if mixed or split.num_decodes:
            found["decode_topk"].append(SIDES["decode_topk"][0 if params["topk"] % 128 == 64 else 1])
    decodes, prefills = lens[:split.num_decodes], lens[split.num_decodes:]
    if not prefills:
        found["split"].append("all decodes")
        if 0 in decodes and split.num_decodes > active_decodes(qsl, split)[1]:
            found["split"].append("with padding requests")
    elif not decodes:
        found["split"].append("all prefills")
    else:
        found["split"].append("decodes + prefills")
    if prefills and any(0 < n <= threshold for n in prefills):
        found["split"].append("a short prefill (<= threshold)")
    if _merged_prefill(lens, split.num_decodes):
        found["split"].append("a prefill as long as the decodes")
    if fp8 and not mixed and prefills and params.get("mqa", "all") == "all":
        seqs = [c + n for c, n in zip(ctx[split.num_decodes:], prefills)]
        max_model_len = params.get("max_model_len") or max(c + n for c, n in zip(ctx, lens))
        workspace = params.get("workspace_size") or prefill_workspace_size(max_model_len)
        n = len(split_prefill_chunks(seqs, workspace))
        found["chunks"].append(SIDES["chunks"][min(n, 3) - 1])
    if dcp > 1:
        empty = any(dcp_local_seq_lens(c + n, dcp, r, interleave) == 0 for c, n in zip(ctx, lens) for r in range(dcp))
        found["dcp_empty"].append(SIDES["dcp_empty"][0 if empty else 1])
    return found


def _merged_prefill(lens: list[int], num_decodes: int) -> bool:
    """Whether the split's decodes hold a request of the first one's length past the first run of
    them (after padding requests): the draws put the decodes first, so it was drawn as a prefill,
    and the uniform split makes it a decode."""
    run = 0
    while run < len(lens) and lens[run] == lens[0]:
        run += 1
    return lens[0] > 0 and any(n == lens[0] for n in lens[run:num_decodes])
