"""The exact reference: slow, eager, readable PyTorch for every path of vLLM's FlashMLA sparse
backend, in float64 by default. It never imports `optimized/` or the harness; it is meant to be
read: each module holds one concern, each function states its formula.

    fp8_ds_mla / nvfp4_ds_mla   the quantized cache row formats
    paged_cache                 writing rows by slot mapping; the flat row view
    attention                   sparse attention, prefill and FP8 decode index forms
    streaming                   the memory budget, and query tokens streamed through it in chunks
    indices                     logical -> physical index conversion, DCP ownership
    metadata                    decode/prefill split, path choice, prefill chunking
    workspace                   gather + up-convert into the BF16 prefill workspace
    query                       query concat and spec-decode reshapes
    dcp                         empty-row neutralization, empty-shard masking and the LSE merge
    forward                     forward_mqa: the three paths end to end, with and without DCP
    hisparse                    host-backed KV: hot cache, swap-in, staged prefill rows, its forward_mqa

DeepSeek V4 / V4.1:
    v4_rows / v41_fp4           the FP8 (V4, V4.1) and FP4 (V4.1 extra) token rows
    v4_pages                    where a page keeps them (block-major, per token); writing by slot
    union                       one softmax over the main and extra top-k lists and a sink
    v4_indices                  the serving index builders (window, vLLM's prefill rows, FlashInfer's table)
    v4_forward                  a V4 decode step: the window's slots, then the union
"""

from .attention import (
    AttentionResult,
    sparse_decode,
    sparse_decode_chunks,
    sparse_decode_fp8,
    sparse_prefill,
    sparse_prefill_chunks,
)
from .dcp import dcp_merge, dcp_merge_exact, mask_empty_shards, merge_weights, neutralize_empty_rows
from .fp8_ds_mla import dequantize_fp8_ds_mla, fp8_ds_mla_values, quantize_fp8_ds_mla
from .forward import MQAMetadata, MQAResult, forward_mqa, forward_mqa_dcp, select_path
from .hisparse import HiSparseTables, forward_mqa_hisparse
from .indices import (
    convert_index,
    dcp_convert_index,
    dcp_local_seq_lens,
    dcp_owner_and_local,
    req_id_per_token,
)
from .metadata import split_prefill_chunks
from .nvfp4_ds_mla import dequantize_nvfp4_ds_mla, nvfp4_ds_mla_values, quantize_nvfp4_ds_mla
from .paged_cache import flat_kv_row_view, write_fp8_ds_mla_cache, write_nvfp4_ds_mla_cache
from .query import concat_mla_q, reshape_attn_output_for_spec_decode, reshape_query_for_spec_decode
from .streaming import memory_budget, memory_limit
from .union import Paged, Rows, lists_of, sparse_decode_union, sparse_decode_union_chunks, sparse_decode_v4, sparse_prefill_union
from .v4_forward import v4_decode
from .v4_indices import flashinfer_decode_table, flashinfer_table_as_union, v4_prefill_indices, window_indices
from .v4_pages import allocate_cache, page_format, slot_values, write_v4_cache
from .workspace import gather_upconvert_fp8, gather_upconvert_nvfp4

__all__ = [
    "AttentionResult", "HiSparseTables", "MQAMetadata", "MQAResult", "concat_mla_q", "convert_index",
    "dcp_convert_index", "dcp_local_seq_lens", "dcp_merge", "dcp_merge_exact", "dcp_owner_and_local",
    "dequantize_fp8_ds_mla", "dequantize_nvfp4_ds_mla", "flat_kv_row_view", "forward_mqa",
    "forward_mqa_dcp", "forward_mqa_hisparse", "fp8_ds_mla_values", "gather_upconvert_fp8", "gather_upconvert_nvfp4",
    "mask_empty_shards", "memory_budget", "memory_limit", "merge_weights", "neutralize_empty_rows", "nvfp4_ds_mla_values",
    "quantize_fp8_ds_mla", "quantize_nvfp4_ds_mla", "req_id_per_token", "reshape_attn_output_for_spec_decode",
    "reshape_query_for_spec_decode", "select_path", "sparse_decode", "sparse_decode_chunks", "sparse_decode_fp8",
    "sparse_prefill", "sparse_prefill_chunks", "split_prefill_chunks", "write_fp8_ds_mla_cache",
    "write_nvfp4_ds_mla_cache",
    # DeepSeek V4 / V4.1
    "Paged", "Rows", "allocate_cache", "flashinfer_decode_table", "flashinfer_table_as_union", "lists_of",
    "page_format", "slot_values", "sparse_decode_union", "sparse_decode_union_chunks", "sparse_decode_v4",
    "sparse_prefill_union", "v4_prefill_indices",
    "v4_decode", "window_indices", "write_v4_cache",
]
