"""The public contract, declared once: one `typing.Protocol` per op, its keyword arguments what
every implementation is called with and its docstring the formula (`reference/` computes it).

The op specs (`equivalence.ops`) take their keywords from here (`arguments`), the subject check
holds a user's callable to them (`equivalence.subject`), `mla-verify list` prints them, and the
contract table of docs/reference/contracts.md is rendered from them (`contract_table`; `scripts/contract_table.py`
rewrites it). Shapes: T tokens, H heads, K top-k width, N kv rows (for dcp_merge and dcp: ranks),
NB blocks of BS slots, B requests of s (S) tokens each, R block-table rows of M blocks,
D = 576 (512 latent + 64 rope); DeepSeek V4's rows are 512 (448 latent + 64 rope, V the whole row).

Each argument's and each return's shape and dtype is an `Annotated` string next to its type:
"[T,H,576] bf16" is a tensor's shape and dtype ("| None" added where the type allows None), a
text in parentheses a note, anything else the values the argument takes. A default is the
reference's (the harness passes every keyword).
"""

from __future__ import annotations

import inspect
import typing
from typing import Annotated, Protocol, Sequence

from torch import Tensor


class QuantizeFp8DsMla(Protocol):
    def __call__(self, *, kv: Annotated[Tensor, "[N,576] bf16"],
                 scale_rule: Annotated[str, '"pow2" | "raw"'] = "pow2") -> Annotated[Tensor, "[N,656] uint8"]:
        """Each row: 512 latent values as e4m3 in 4 tiles of 128, each tile scaled by s = amax / 448
        (scale_rule "pow2": s rounded up to a power of two), the 4 fp32 scales, then the 64 rope
        values as bf16. Bytes exact."""


class DequantizeFp8DsMla(Protocol):
    def __call__(self, *, rows: Annotated[Tensor, "[N,656] uint8"]
                 ) -> Annotated[Tensor, "[N,576] bf16 = bf16(fp32(e4m3) * scale)"]:
        """Per tile of 128 latent values with its fp32 scale; the 64 rope values copied. Bits exact."""


class WriteFp8DsMlaCache(Protocol):
    def __call__(self, *, kv: Annotated[Tensor, "[N,576] bf16"], kv_cache: Annotated[Tensor, "[NB,BS,656] uint8"],
                 slot_mapping: Annotated[Tensor, "[N]"], scale_rule: Annotated[str, '"pow2" | "raw"'] = "pow2"
                 ) -> Annotated[None, "None (in place; slot < 0 skipped)"]:
        """kv_cache[slot // BS, slot % BS] = quantize_fp8_ds_mla(kv[i]) for slot = slot_mapping[i] >= 0;
        slot -1 skips the row. Writes in place; every other byte of the cache's storage is unchanged."""


class SparsePrefill(Protocol):
    def __call__(self, *, q: Annotated[Tensor, "[T,H,576] bf16"], kv: Annotated[Tensor, "[N,576] bf16"],
                 indices: Annotated[Tensor, "[T,K] int32"], sm_scale: float,
                 topk_length: Annotated[Tensor | None, "[T] int32"], attn_sink: Annotated[Tensor | None, "[H] f32"]
                 ) -> Annotated[tuple[Tensor, ...], "(out[T,H,512] bf16, lse[T,H] f32[, max_logits[T,H] f32])"]:
        """An index i_j is valid when 0 <= i_j < N and, with topk_length, its position < topk_length[t].
        s_j = sm_scale * q . kv[i_j]; lse = ln sum_j e^(s_j) (+inf with no valid index),
        max_logits = max_j s_j (-inf); out = sum_j e^(s_j - lse) kv[i_j, :512] * sigmoid(lse - sink[h])
        (0 with no valid index)."""


class SparseDecodeFp8(Protocol):
    def __call__(self, *, q: Annotated[Tensor, "[B,S,H,576] bf16"],
                 kv_cache: Annotated[Tensor, "[NB,BS,656] uint8 fp8_ds_mla"],
                 indices: Annotated[Tensor, "[B,S,K] int32"], sm_scale: float
                 ) -> Annotated[tuple[Tensor, Tensor], "(out[B,S,H,512] bf16, lse[B,H,S] f32)"]:
        """indices are physical slots (block * BS + offset; -1 the only invalid value). The prefill
        formula over the dequantized rows, no sink."""


class ConvertIndex(Protocol):
    def __call__(self, *, req_id: Annotated[Tensor, "[T] int32"], block_table: Annotated[Tensor, "[R,M] int32"],
                 topk_indices: Annotated[Tensor, "[T,K] int32"], block_size: int,
                 block_stride_rows: int | None = None,
                 prefill_request_ids: Annotated[Tensor | None, "[T] (-1: not a prefill token)"] = None,
                 prefill_workspace_starts: Annotated[Tensor | None, "[P]"] = None, return_valid_counts: bool = False,
                 idx_mapping: Annotated[Tensor | None, "(table row = max(idx_mapping[req_id], 0))"] = None
                 ) -> Annotated[Tensor | tuple[Tensor, Tensor],
                                "[T,K] int32, or with counts ([T,K], [T]); for non-power-of-two K past 4096 "
                                "the valid prefix is compared as a set"]:
        """Logical top-k -> physical rows: p = block_table[r, i // BS] * stride + i % BS for the
        token's request r (through idx_mapping when given); a prefill token reads its workspace,
        workspace_start + i. Invalid (-1, past the table) stays -1; with return_valid_counts the
        valid entries are compacted to the front (stably) and counted."""


class DcpConvertIndex(Protocol):
    def __call__(self, *, req_id: Annotated[Tensor, "[T] int32"], block_table: Annotated[Tensor, "[R,M] int32"],
                 topk_indices: Annotated[Tensor, "[T,K] int32"], block_size: int, dcp_size: int, dcp_rank: int,
                 interleave: int, compact_valid_to_front: Annotated[bool, "(ignored at dcp_size 1, as upstream)"]
                 ) -> Annotated[Tensor, "[T,K] int32"]:
        """Global top-k -> this rank's physical slots: position i belongs to rank (i // interleave) % N
        and sits at local position (i // (N * interleave)) * interleave + i % interleave of its shard;
        other ranks' entries -1; compacted (stably) iff compact_valid_to_front and N > 1."""


class GatherUpconvertFp8(Protocol):
    def __call__(self, *, kv_cache: Annotated[Tensor, "[NB,BS,656] uint8 fp8_ds_mla"],
                 block_table: Annotated[Tensor, "[P,M]"], workspace_starts: Annotated[Tensor, "[P]"], num_rows: int
                 ) -> Annotated[Tensor, "[num_rows,576] bf16"]:
        """The cache -> a bf16 workspace: request r's positions 0..len-1 dequantized into rows
        workspace_starts[r] + position. Bits exact."""


class GatherUpconvertNvfp4(Protocol):
    def __call__(self, *, kv_cache: Annotated[Tensor, "[NB,BS,352] uint8 nvfp4_ds_mla"],
                 block_table: Annotated[Tensor, "[P,M]"], workspace_starts: Annotated[Tensor, "[P]"], num_rows: int
                 ) -> Annotated[Tensor, "[num_rows,576] bf16"]:
        """As gather_upconvert_fp8, from an nvfp4_ds_mla cache."""


class DcpMerge(Protocol):
    def __call__(self, *, outs: Annotated[Tensor, "[N,T,H,D] bf16 (every rank's partial)"],
                 lses: Annotated[Tensor, "[N,T,H] f32"]
                 ) -> Annotated[tuple[Tensor, Tensor], "(out[T,H,D] bf16, lse[T,H] f32)"]:
        """A partial whose lse is NaN or +inf is undefined and dropped:
        lse = ln sum_r e^(lse_r), out = sum_r bf16(e^(lse_r - lse) out_r)."""


class ConcatMlaQ(Protocol):
    def __call__(self, *, ql_nope: Annotated[Tensor, "[T,H,512]"], q_pe: Annotated[Tensor, "[T,H,64]"]
                 ) -> Annotated[Tensor, "[T,H,576] bf16"]:
        """q[t, h] = [ql_nope[t, h] (512) | q_pe[t, h] (64)], a dense copy."""


class SplitPrefillChunks(Protocol):
    def __call__(self, *, seq_lens: Sequence[int], workspace_size: int) -> list[tuple[int, int]]:
        """Greedy runs of consecutive requests whose total length fits the workspace (<=), as
        (start, end) request ranges: [2, 3, 4, 2] / 5 -> [(0, 2), (2, 3), (3, 4)]."""


class ReshapeQueryForSpecDecode(Protocol):
    def __call__(self, *, q: Annotated[Tensor, "[B*s,H,D]"], num_decodes: int) -> Annotated[Tensor, "[B,s,H,D]"]:
        """Token-major: B = num_decodes requests of s tokens each (a view may be returned)."""


class ReshapeAttnOutputForSpecDecode(Protocol):
    def __call__(self, *, out: Annotated[Tensor, "[B,s,H,D]"]) -> Annotated[Tensor, "[B*s,H,D]"]:
        """The inverse of reshape_query_for_spec_decode; a 3-D tensor unchanged (a view may be returned)."""


class ForwardMqa(Protocol):
    def __call__(self, *, q: Tensor | tuple[Tensor, Tensor], kv_cache: Tensor, query_start_loc: Tensor,
                 seq_lens: Tensor, block_table: Tensor, topk_indices: Tensor, num_heads: int, kv_cache_dtype: str,
                 sm_scale: float, max_model_len: int) -> Annotated[tuple[Tensor, Tensor], "(out[T,H,512], lse[T,H])"]:
        """FlashMLASparseImpl.forward_mqa, whole: the batch's top-k (logical positions per token)
        converted to cache rows, attended on the path the cache dtype and head count select (bf16,
        fp8_mixed, fp8_separate with its chunked prefill workspace)."""


class DcpForwardMqa(Protocol):
    def __call__(self, *, q: Annotated[Tensor, "[T,H,576] (this rank's heads)"],
                 kv_cache: Annotated[Tensor, "(this rank's shard)"],
                 group: Annotated[object, "a torch.distributed process group"], query_start_loc: Tensor,
                 seq_lens: Tensor, block_table: Annotated[Tensor, "(this rank's shard)"], topk_indices: Tensor,
                 num_heads: int, kv_cache_dtype: str, sm_scale: float, max_model_len: int,
                 combine: Annotated[str, '"ag_rs" | "a2a"'], interleave: int
                 ) -> Annotated[tuple[Tensor, ...],
                                "(out[T,H,512], lse[T,H][, partial_out[T,N*H,512], partial_lse[T,N*H]])"]:
        """One rank's body of decode context parallelism in process group `group`: q all-gathered
        over the heads, forward_mqa on this rank's shard of the cache, the partials combined
        (combine "ag_rs": all-gather of LSEs and reduce-scatter of the scaled outputs; "a2a":
        all-to-all). out and lse are this rank's heads'; partial_out and partial_lse, when
        returned, its pre-combine partials."""



class SparseDecodeV4(Protocol):
    def __call__(self, *, q: Annotated[Tensor, "[B,S,H,512] bf16"],
                 kv_cache: Annotated[Tensor, "[NB,BS,584] uint8 V4 (block-major pages)"],
                 indices: Annotated[Tensor, "[B,S,K] int32"], sm_scale: float,
                 topk_length: Annotated[Tensor | None, "[B] int32 (per request)"],
                 extra_kv_cache: Annotated[Tensor | None, "[NB2,BS2,584] uint8 V4"],
                 extra_indices: Annotated[Tensor | None, "[B,S,K2] int32"],
                 extra_topk_length: Annotated[Tensor | None, "[B] int32 (per request)"],
                 attn_sink: Annotated[Tensor | None, "[H] f32"]
                 ) -> Annotated[tuple[Tensor, Tensor], "(out[B,S,H,512] bf16, lse[B,H,S] f32)"]:
        """One softmax over the union of the main and the extra list: entry j of request b counts when
        j < its list's length[b] and its value is not -1 (past a length: never read, any value;
        within it: -1 or a slot of its cache). s_j = sm_scale * q . K_j over the 512 dims of the
        dequantized row; lse = ln sum_j e^(s_j) (+inf on an empty union); out = sum_j e^(s_j - lse)
        K_j * sigmoid(lse - sink[h]) (0 on an empty union): V is the whole row."""


class SparseDecodeV41(Protocol):
    def __call__(self, *, q: Annotated[Tensor, "[B,S,H,512] bf16"],
                 kv_cache: Annotated[Tensor, "[NB,BS,528] uint8 V4.1 (per-token pages)"],
                 indices: Annotated[Tensor, "[B,S,K] int32"], sm_scale: float,
                 topk_length: Annotated[Tensor | None, "[B] int32 (per request)"],
                 extra_kv_cache: Annotated[Tensor | None, "[NB2,BS2,528] V4.1 or [NB2,BS2,288] V4.1 FP4, uint8"],
                 extra_indices: Annotated[Tensor | None, "[B,S,K2] int32"],
                 extra_topk_length: Annotated[Tensor | None, "[B] int32 (per request)"],
                 attn_sink: Annotated[Tensor | None, "[H] f32"]
                 ) -> Annotated[tuple[Tensor, Tensor], "(out[B,S,H,512] bf16, lse[B,H,S] f32)"]:
        """sparse_decode_v4's union over V4.1 rows: 512 e4m3 values in ue8m0-scaled tiles of 32, the
        extra cache V4.1 or FP4 (e2m1, even dim in the low nibble, e4m3-scaled tiles of 16)."""


class WriteV4Cache(Protocol):
    def __call__(self, *, kv: Annotated[Tensor, "[N,512] bf16"], kv_cache: Annotated[Tensor, "[NB,BS,584] uint8"],
                 slot_mapping: Annotated[Tensor, "[N]"],
                 scale_rule: Annotated[str, '"pow2" | "pow2_amax"'] = "pow2"
                 ) -> Annotated[None, "None (in place; slot < 0 skipped)"]:
        """Row i quantized to V4 (448 e4m3 in tiles of 64 with ue8m0 scales 2^ceil(log2(max(amax / 448,
        1e-4))), "pow2_amax": max(amax, 1e-4) / 448; 64 bf16 RoPE) and written where a block-major
        page keeps slot slot_mapping[i]. Every other byte unchanged."""


class WriteV41Cache(Protocol):
    def __call__(self, *, kv: Annotated[Tensor, "[N,512] bf16"],
                 kv_cache: Annotated[Tensor, "[NB,BS,528] or [NB,BS,288] uint8"], slot_mapping: Annotated[Tensor, "[N]"],
                 scale_rule: Annotated[str, '"pow2" | "pow2_amax"'] = "pow2"
                 ) -> Annotated[None, "None (in place; slot < 0 skipped)"]:
        """As write_v4_cache into per-token V4.1 pages (512 e4m3 in ue8m0 tiles of 32) or V4.1 FP4 pages
        (e2m1 codes of x / sf, sf = e4m3(clamp(amax / 6, 2^-9, 448)) per tile of 16). Bytes exact."""


class WindowIndices(Protocol):
    def __call__(self, *, positions: Annotated[Tensor, "[T]"], req_of_token: Annotated[Tensor, "[T]"],
                 block_table: Annotated[Tensor, "[R,M] int32"], block_size: int, window: int
                 ) -> Annotated[tuple[Tensor, Tensor], "(indices[T,window] int32, lengths[T] int32)"]:
        """w = min(pos + 1, window); indices[t, i] = slot of position pos - w + 1 + i through the
        request's block table (i < w), -1 after; lengths[t] = w."""


class V4PrefillIndices(Protocol):
    def __call__(self, *, topk_indices: Annotated[Tensor, "[T,>=topk] int32 (local picks)"],
                 query_start_loc: Annotated[Tensor, "[R+1] int32"], seq_lens: Annotated[Tensor, "[R] int32"],
                 gather_lens: Annotated[Tensor, "[R] int32"], window: int, compress_ratio: int, topk: int, m: int,
                 n: int) -> Annotated[tuple[Tensor, Tensor], "(rows[T,ceil((topk+window)/128)*128] int32, lengths[T])"]:
        """vLLM's prefill rows over a buffer of M rows a request (N compressed entries, then its last
        gather_len raw tokens): k = min((pos + 1) // compress_ratio, topk) picks + M r, then the
        w = min(pos + 1, window) window rows M r + N + pos - w + 1 - (seq_len - gather_len) + i, then -1;
        lengths k + w."""


class FlashinferDecodeTable(Protocol):
    def __call__(self, *, window_slots: Annotated[Tensor, "[T,W] int32"],
                 compressed_slots: Annotated[Tensor, "[T,K] int32"],
                 compressed_lens: Annotated[Tensor | None, "[T] int32"]
                 ) -> Annotated[tuple[Tensor, Tensor], "(table[T,W+ceil4(K)] int32, lengths[T] int32)"]:
        """FlashInfer's one table: the window's slots, then the compressed slots, then -1; each length
        counts the whole window: W + compressed_lens[t] (K without them)."""


class V4Decode(Protocol):
    def __call__(self, *, q: Annotated[Tensor, "[B,S,H,512] bf16"],
                 kv_cache: Annotated[Tensor, "[NB,BS,584] uint8 V4 (the window's pages)"],
                 positions: Annotated[Tensor, "[B] int32 (each request's last query position)"],
                 block_table: Annotated[Tensor, "[B,M] int32"], sm_scale: float,
                 extra_kv_cache: Annotated[Tensor | None, "[NB2,BS2,584] uint8 V4"],
                 extra_indices: Annotated[Tensor | None, "[B,S,K2] int32"],
                 extra_topk_length: Annotated[Tensor | None, "[B] int32"],
                 attn_sink: Annotated[Tensor | None, "[H] f32"]
                 ) -> Annotated[tuple[Tensor, Tensor], "(out[B,S,H,512] bf16, lse[B,H,S] f32)"]:
        """A V4 decode step: each token's window of 128 (window_indices over its position pos =
        positions[b] - S + 1 + s and the request's block table), the request's length the last
        token's window, then sparse_decode_v4 over the window and the extra list."""

CONTRACTS: dict[str, type] = {
    "quantize_fp8_ds_mla": QuantizeFp8DsMla, "dequantize_fp8_ds_mla": DequantizeFp8DsMla,
    "write_fp8_ds_mla_cache": WriteFp8DsMlaCache, "sparse_prefill": SparsePrefill,
    "sparse_decode_fp8": SparseDecodeFp8, "convert_index": ConvertIndex, "dcp_convert_index": DcpConvertIndex,
    "gather_upconvert_fp8": GatherUpconvertFp8, "gather_upconvert_nvfp4": GatherUpconvertNvfp4,
    "dcp_merge": DcpMerge, "concat_mla_q": ConcatMlaQ, "split_prefill_chunks": SplitPrefillChunks,
    "reshape_query_for_spec_decode": ReshapeQueryForSpecDecode,
    "reshape_attn_output_for_spec_decode": ReshapeAttnOutputForSpecDecode, "forward_mqa": ForwardMqa,
    "dcp": DcpForwardMqa, "sparse_decode_v4": SparseDecodeV4, "sparse_decode_v41": SparseDecodeV41,
    "write_v4_cache": WriteV4Cache, "write_v41_cache": WriteV41Cache, "window_indices": WindowIndices,
    "v4_prefill_indices": V4PrefillIndices, "flashinfer_decode_table": FlashinferDecodeTable, "v4_decode": V4Decode,
}


def arguments(op: str) -> tuple[str, ...]:
    """The keyword arguments every implementation of `op` is called with, in the contract's order."""
    return tuple(p for p in inspect.signature(CONTRACTS[op].__call__).parameters if p != "self")


def formula(op: str) -> str:
    """`op`'s formula: its Protocol's docstring."""
    return inspect.getdoc(CONTRACTS[op].__call__) or ""


def _hints(op: str) -> dict[str, object]:
    return typing.get_type_hints(CONTRACTS[op].__call__, include_extras=True)


def _argument(param: inspect.Parameter, hint: object) -> str:
    """One keyword as the table shows it: its shape and dtype, its values or its type, its default
    and its note (the module docstring says how the `Annotated` text reads)."""
    annotated = typing.get_origin(hint) is Annotated
    base, text = (hint.__origin__, hint.__metadata__[0]) if annotated else (hint, "")
    if text.startswith("("):
        shape, note = "", f" {text}"
    else:
        shape, paren, rest = text.partition(" (")
        note = f" ({rest}" if paren else ""
    if not annotated:
        shown = param.name if base is Tensor else f"{param.name}: {param.annotation}"
    elif base is Tensor or Tensor in typing.get_args(base):
        shown = param.name + shape + (" | None" if type(None) in typing.get_args(base) else "")
    else:
        shown = f"{param.name}: {shape or base.__name__}"
    if param.default is not inspect.Parameter.empty:
        default = param.default
        shown += f' = "{default}"' if isinstance(default, str) else f" = {default!r}"
    return shown + note


def declared(op: str) -> tuple[str, ...]:
    """`op`'s keywords with their shapes, dtypes, values, defaults and notes, in the contract's order."""
    hints = _hints(op)
    params = inspect.signature(CONTRACTS[op].__call__).parameters
    return tuple(_argument(params[name], hints[name]) for name in arguments(op))


def call(op: str) -> str:
    """`op`'s call as the docs' contract table shows it: its `declared` keywords."""
    return ", ".join(declared(op))


def returns(op: str) -> str:
    """What `op` returns, with shapes and dtypes."""
    hint = _hints(op)["return"]
    if typing.get_origin(hint) is Annotated:
        return hint.__metadata__[0]
    return str(inspect.signature(CONTRACTS[op].__call__).return_annotation)


V4_OPS = ("sparse_decode_v4", "sparse_decode_v41", "write_v4_cache", "write_v41_cache", "window_indices",
          "v4_prefill_indices", "flashinfer_decode_table", "v4_decode")


def contract_table(ops: Sequence[str] | None = None) -> str:
    """The docs' contract table (between its `<!-- contracts:begin -->` and `end` markers):
    one row per op (`ops`, default every one), its call and what it returns.
    `python scripts/contract_table.py` writes it."""
    def code(text: str) -> str:
        return "`" + text.replace("|", "\\|") + "`"

    rows = ["| op | call | returns |", "|---|---|---|"]
    rows += [f"| {code(op)} | {code(call(op))} | {code(returns(op))} |" for op in (ops or CONTRACTS)]
    return "\n".join(rows) + "\n"
