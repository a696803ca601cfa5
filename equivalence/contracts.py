"""The public contract, declared once: one `typing.Protocol` per op, its keyword arguments what
every implementation is called with and its docstring the formula (`reference/` computes it).

The op specs (`equivalence.ops`) take their keywords from here (`arguments`), the subject check
holds a user's callable to them (`equivalence.subject`), and `mla-verify list` prints them. Shapes:
T tokens, H heads, K top-k width, N kv rows, NB blocks of BS slots, D = 576 (512 latent + 64 rope).
"""

from __future__ import annotations

import inspect
from typing import Protocol, Sequence

from torch import Tensor


class QuantizeFp8DsMla(Protocol):
    def __call__(self, *, kv: Tensor, scale_rule: str) -> Tensor:
        """[N, 576] bf16 -> [N, 656] uint8 rows: 512 latent values as e4m3 in 4 tiles of 128, each
        tile scaled by s = amax / 448 (scale_rule "pow2": s rounded up to a power of two), the 4 fp32
        scales, then the 64 rope values as bf16. Bytes exact."""


class DequantizeFp8DsMla(Protocol):
    def __call__(self, *, rows: Tensor) -> Tensor:
        """[N, 656] uint8 -> [N, 576] bf16: bf16(fp32(e4m3) * scale) per tile, rope copied. Bits exact."""


class WriteFp8DsMlaCache(Protocol):
    def __call__(self, *, kv: Tensor, kv_cache: Tensor, slot_mapping: Tensor, scale_rule: str) -> None:
        """kv_cache[slot // BS, slot % BS] = quantize_fp8_ds_mla(kv[i]) for slot = slot_mapping[i] >= 0;
        slot -1 skips the row. Writes in place; every other byte of the cache's storage is unchanged."""


class SparsePrefill(Protocol):
    def __call__(self, *, q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float, topk_length: Tensor | None,
                 attn_sink: Tensor | None) -> tuple[Tensor, ...]:
        """q [T, H, 576] bf16, kv [N, 576] bf16, indices [T, K] int32 (valid: 0 <= i < N and, with
        topk_length, position < topk_length[t]). s_j = sm_scale * q . kv[i_j];
        lse = ln sum_j e^(s_j) (+inf with no valid index), max_logits = max_j s_j (-inf);
        out = sum_j e^(s_j - lse) kv[i_j, :512] * sigmoid(lse - sink[h]) (0 with no valid index).
        Returns (out [T, H, 512] bf16, lse [T, H] fp32[, max_logits [T, H] fp32])."""


class SparseDecodeFp8(Protocol):
    def __call__(self, *, q: Tensor, kv_cache: Tensor, indices: Tensor, sm_scale: float) -> tuple[Tensor, Tensor]:
        """q [B, S, H, 576] bf16, kv_cache [NB, BS, 656] uint8 fp8_ds_mla, indices [B, S, K] int32
        physical slots (block * BS + offset; -1 the only invalid value). The prefill formula over
        the dequantized rows, no sink. Returns (out [B, S, H, 512] bf16, lse [B, H, S] fp32)."""


class ConvertIndex(Protocol):
    def __call__(self, *, req_id: Tensor, block_table: Tensor, topk_indices: Tensor, block_size: int,
                 block_stride_rows: int | None, prefill_request_ids: Tensor | None,
                 prefill_workspace_starts: Tensor | None, return_valid_counts: bool,
                 idx_mapping: Tensor | None) -> Tensor | tuple[Tensor, Tensor]:
        """Logical top-k -> physical rows: p = block_table[r, i // BS] * stride + i % BS for the
        token's request r (through idx_mapping when given); a prefill token reads its workspace,
        workspace_start + i. Invalid (-1, past the table) stays -1; with return_valid_counts the
        valid entries are compacted to the front (stably) and counted. int32 [T, K] (+ counts [T])."""


class DcpConvertIndex(Protocol):
    def __call__(self, *, req_id: Tensor, block_table: Tensor, topk_indices: Tensor, block_size: int, dcp_size: int,
                 dcp_rank: int, interleave: int, compact_valid_to_front: bool) -> Tensor:
        """Global top-k -> this rank's physical slots: position i belongs to rank (i // interleave) % N
        and sits at local position (i // (N * interleave)) * interleave + i % interleave of its shard;
        other ranks' entries -1; compacted (stably) iff compact_valid_to_front and N > 1. int32 [T, K]."""


class GatherUpconvertFp8(Protocol):
    def __call__(self, *, kv_cache: Tensor, block_table: Tensor, workspace_starts: Tensor, num_rows: int) -> Tensor:
        """[NB, BS, 656] fp8_ds_mla cache -> [num_rows, 576] bf16 workspace: request r's positions
        0..len-1 dequantized into rows workspace_starts[r] + position. Bits exact."""


class GatherUpconvertNvfp4(Protocol):
    def __call__(self, *, kv_cache: Tensor, block_table: Tensor, workspace_starts: Tensor, num_rows: int) -> Tensor:
        """[NB, BS, 352] nvfp4_ds_mla cache -> [num_rows, 576] bf16 workspace, as gather_upconvert_fp8."""


class DcpMerge(Protocol):
    def __call__(self, *, outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
        """outs [N, T, H, 512], lses [N, T, H] (NaN or +inf: an undefined partial, dropped):
        lse = ln sum_r e^(lse_r), out = sum_r bf16(e^(lse_r - lse) out_r). Returns (out bf16, lse fp32)."""


class ConcatMlaQ(Protocol):
    def __call__(self, *, ql_nope: Tensor, q_pe: Tensor) -> Tensor:
        """q[t, h] = [ql_nope[t, h] (512) | q_pe[t, h] (64)], a dense bf16 [T, H, 576] copy."""


class SplitPrefillChunks(Protocol):
    def __call__(self, *, seq_lens: Sequence[int], workspace_size: int) -> list[tuple[int, int]]:
        """Greedy runs of consecutive requests whose total length fits the workspace (<=), as
        (start, end) request ranges: [2, 3, 4, 2] / 5 -> [(0, 2), (2, 3), (3, 4)]."""


class ReshapeQueryForSpecDecode(Protocol):
    def __call__(self, *, q: Tensor, num_decodes: int) -> Tensor:
        """[B * s, H, D] -> [B, s, H, D], token-major (a view may be returned)."""


class ReshapeAttnOutputForSpecDecode(Protocol):
    def __call__(self, *, out: Tensor) -> Tensor:
        """[B, s, H, D] -> [B * s, H, D]; a 3-D tensor unchanged (a view may be returned)."""


class ForwardMqa(Protocol):
    def __call__(self, *, q: Tensor | tuple[Tensor, Tensor], kv_cache: Tensor, query_start_loc: Tensor,
                 seq_lens: Tensor, block_table: Tensor, topk_indices: Tensor, num_heads: int, kv_cache_dtype: str,
                 sm_scale: float, max_model_len: int) -> tuple[Tensor, Tensor]:
        """FlashMLASparseImpl.forward_mqa: the batch's top-k (logical positions per token) converted
        to cache rows, attended on the path the cache dtype and head count select (bf16, fp8_mixed,
        fp8_separate with its chunked prefill workspace). Returns (out [T, H, 512], lse [T, H])."""


class DcpForwardMqa(Protocol):
    def __call__(self, *, q: Tensor, kv_cache: Tensor, group: object, query_start_loc: Tensor, seq_lens: Tensor,
                 block_table: Tensor, topk_indices: Tensor, num_heads: int, kv_cache_dtype: str, sm_scale: float,
                 max_model_len: int, combine: str, interleave: int) -> tuple[Tensor, ...]:
        """One rank of decode context parallelism in process group `group`: q all-gathered over the
        heads, forward_mqa on this rank's shard of the cache, the partials combined (combine
        "ag_rs": all-gather of LSEs and reduce-scatter of the scaled outputs; "a2a": all-to-all).
        Returns (out, lse) of this rank's heads[, its pre-combine partial out and lse]."""


CONTRACTS: dict[str, type] = {
    "quantize_fp8_ds_mla": QuantizeFp8DsMla, "dequantize_fp8_ds_mla": DequantizeFp8DsMla,
    "write_fp8_ds_mla_cache": WriteFp8DsMlaCache, "sparse_prefill": SparsePrefill,
    "sparse_decode_fp8": SparseDecodeFp8, "convert_index": ConvertIndex, "dcp_convert_index": DcpConvertIndex,
    "gather_upconvert_fp8": GatherUpconvertFp8, "gather_upconvert_nvfp4": GatherUpconvertNvfp4,
    "dcp_merge": DcpMerge, "concat_mla_q": ConcatMlaQ, "split_prefill_chunks": SplitPrefillChunks,
    "reshape_query_for_spec_decode": ReshapeQueryForSpecDecode,
    "reshape_attn_output_for_spec_decode": ReshapeAttnOutputForSpecDecode, "forward_mqa": ForwardMqa,
    "dcp": DcpForwardMqa,
}


def arguments(op: str) -> tuple[str, ...]:
    """The keyword arguments every implementation of `op` is called with, in the contract's order."""
    return tuple(p for p in inspect.signature(CONTRACTS[op].__call__).parameters if p != "self")


def formula(op: str) -> str:
    """`op`'s formula: its Protocol's docstring."""
    return inspect.getdoc(CONTRACTS[op].__call__) or ""
