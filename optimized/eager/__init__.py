"""Plain float32 eager PyTorch for every tensor stage, registered as implementation "torch-fp32".

Two jobs: the portable fallback wherever no kernel runs, and the oracle's calibration subject (a
correct implementation the harness must never flag). So every function is exact on every valid
input (invalid-index forms, empty rows, duplicates, strided caches) and computes in float32:
attention errors stay around 1e-6 of the values, far inside any bf16-level bound.

Written independently of `reference/` on purpose (shared code would hide a shared bug): number
formats are decoded through 256-entry tables built from the bit fields, e4m3 rounding is done
arithmetically, bytes are assembled with shifts, workspace rows find their request with a
cumsum of markers rather than a binary search, and compaction is a cumsum-scatter.

One module per concern, named as in `reference/`:

    common                      registration, chunking, fp32 matmuls, byte packing, the e4m3 table
    fp8_ds_mla / nvfp4_ds_mla   the quantized cache row formats
    paged_cache                 the paged cache: checks, slots, the fp8 writer, row up-convert
    workspace                   gather + up-convert into the bf16 prefill workspace
    indices                     logical -> physical index conversion, the DCP filter
    attention                   sparse prefill and decode, and their float32 core `attend`
    query                       query concat
    dcp                         the LSE merges of both DCP combines
"""

from .attention import attend, sparse_decode_fp8, sparse_decode_nvfp4, sparse_prefill
from .dcp import dcp_a2a_merge, dcp_lse_correct, dcp_merge
from .fp8_ds_mla import dequantize_fp8_ds_mla, quantize_fp8_ds_mla
from .indices import convert_index, dcp_convert_index
from .paged_cache import write_fp8_ds_mla_cache
from .query import concat_mla_q
from .workspace import gather_upconvert_fp8, gather_upconvert_nvfp4

__all__ = [
    "attend", "concat_mla_q", "convert_index", "dcp_a2a_merge", "dcp_convert_index", "dcp_lse_correct",
    "dcp_merge", "dequantize_fp8_ds_mla", "gather_upconvert_fp8", "gather_upconvert_nvfp4",
    "quantize_fp8_ds_mla", "sparse_decode_fp8", "sparse_decode_nvfp4", "sparse_prefill",
    "write_fp8_ds_mla_cache",
]
