"""Property cases at production shapes: 64-128 heads, top-k 2048, decode batches of 64, contexts
of 1-4K tokens. Sized for a GPU (each builds its cache on the CPU in a few seconds); the GPU tests
and scripts/gpu_properties.py run them for every implementation.
"""

from __future__ import annotations

from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.properties.base import PREFIX

HEADS, TOPK, SM_SCALE = 128, 2048, 0.1352
PREFILL = dict(tokens=64, heads=HEADS, kv_rows=8192, topk=TOPK, value_regime="normal", sm_scale=SM_SCALE,
               invalid=["scattered"], topk_length="random", sink="finite")
DECODE = dict(batch=64, s_q=1, heads=HEADS, topk=TOPK, seq_lens=[4096] * 64, page_size=64, stride_pad=0,
              value_regime="normal", scale_rule="pow2", sm_scale=SM_SCALE, invalid=["scattered"])
# DeepSeek V4 decode as served: 64 requests of 4 MTP tokens deep into their sequences, a 128-token
# window in 256-token pages plus 512 compressed picks in 64-token pages, a sink per head.
V4_DECODE = dict(batch=64, s_q=4, heads=HEADS, topk=128, extra_topk=512, positions=[4096] * 64, block_size=256,
                 extra_block_size=64, kv_format="V4", extra_format="V4", compress_ratio=4, lengths="exact",
                 sm_scale=SM_SCALE, value_regime="normal", scale_rule="pow2", invalid=["scattered"], sink="finite")
V41_DECODE = {**V4_DECODE, "kv_format": "V41", "extra_format": "V41_FP4"}
# A separate-path batch: 16 decodes and 2 prefills over contexts of 1-4K tokens.
FORWARD = dict(cache_dtype="fp8_ds_mla", heads=64, query_lens=[1] * 16 + [128, 256], context_lens=[4096] * 16 + [1024, 2048],
               block_size=64, stride_pad=0, spare_blocks=1, shuffle=True, table_pad=0, topk=TOPK, sm_scale=SM_SCALE,
               value_regime="normal", scale_rule="pow2", invalid=["scattered"], mqa="all", q_form="tensor", arch="sm90",
               max_decode_query_len=1, max_model_len=4097, workspace_size=None, dcp_size=1, interleave=1)
# Two prefills longer than the decode threshold (256 at 64 heads), chunked by a 3372-row workspace.
PREFILLS = dict(query_lens=[260, 300], context_lens=[2048, 3072], max_model_len=3372)

PINNED: dict[str, dict[str, dict]] = {
    "split_invariance": {
        "sparse_prefill": {**PREFILL, "sink": "none", "parts": 4, "scheme": "random"},
        "sparse_decode_fp8": {**DECODE, "parts": 4, "scheme": "residue"},
    },
    "decode_equals_prefill": {"sparse_decode_fp8": {**DECODE, "heads": 64}},
    "padding_and_order": {
        "sparse_prefill": {**PREFILL, "tokens": 32, "heads": 64, "pad_tokens": 8, "pad_token_rows": "live", "pad_heads": 64,
                           "wider": 128},
        "sparse_decode_fp8": {**DECODE, "batch": 56, "heads": 64, "pad_tokens": 8, "pad_token_rows": "empty", "pad_heads": 64,
                              "wider": 64},
        "forward_mqa": {**FORWARD, "pad_columns": 2, "pad_fill": "blocks"},
    },
    "batch_invariance": {
        "sparse_decode_fp8": {**DECODE, "alone": [0, 37]},
        "forward_mqa": {**FORWARD, **PREFILLS, "workspace_size": 3372},
    },
    "spec_decode": {
        "sparse_decode_fp8": {**DECODE, "batch": 32, "s_q": 2, "seq_lens": [4096] * 32},
        "forward_mqa": {**FORWARD, "query_lens": [2] * 32, "context_lens": [4096] * 32, "max_decode_query_len": 2,
                        "max_model_len": 4098},
    },
    "dcp_size_one": {
        "dcp_convert_index": dict(tokens=256, requests=8, table_width=64, topk=TOPK, block_size=64, dcp_size=1,
                                  dcp_rank=0, interleave=1, compact=True, invalid=["scattered"]),
        "forward_mqa": {**FORWARD, "heads": 16, "query_lens": [1] * 32 + [64], "context_lens": [4096] * 33,
                        "max_model_len": 4160},
        "dcp_merge": dict(ranks=1, tokens=256, heads=HEADS, empty_frac=0.3),
    },
    # A bf16 HiSparse batch over two layers: 16 decodes swapped into a hot cache sized to fit, and
    # two staged prefills, against the same batch on the plain path.
    "hisparse_equals_plain": {
        "forward_mqa": dict(cache_dtype="bfloat16", heads=64, query_lens=[1] * 16 + [128, 256],
                            context_lens=[4096] * 16 + [1024, 2048], block_size=64, stride_blocks=1, spare_blocks=1,
                            spare_state_rows=0, shuffle=True, slot_perm=True, table_pad=0, topk=TOPK,
                            sm_scale=SM_SCALE, value_regime="normal", scale_rule="pow2", invalid=["scattered"],
                            hisparse=True, layers=2, buffer_rows=512, hot_slack=0, prior_hits=0.5,
                            resident_frac=0.0, swap_rows="fit", max_decode_query_len=1, max_model_len=4097,
                            workspace_size=None),
    },
    # Captured on the case's seed, replayed on three others (vLLM captures the decode at batch sizes up to 512).
    "cuda_graph": {
        "sparse_prefill": {**PREFILL, "replay_seeds": [11, 12, 13]},
        "sparse_decode_fp8": {**DECODE, "s_q": 2, "replay_seeds": [11, 12, 13]},
        "forward_mqa": {**FORWARD, "query_lens": [2] * 32, "context_lens": [4096] * 32, "max_decode_query_len": 2,
                        "max_model_len": 4098, "replay_seeds": [11, 12, 13]},
    },
    "singleton": {"sparse_prefill": PREFILL},
    "stress": {"sparse_prefill": PREFILL, "sparse_decode_fp8": DECODE},
    "layer_view": {"forward_mqa": FORWARD,
                   "write_fp8_ds_mla_cache": dict(n=4096, num_blocks=80, block_size=64, value_regime="normal",
                                                  scale_rule="raw", stride_pad=0, skip_frac=0.2)},
    "v4_union_merge": {"sparse_decode_v4": V4_DECODE, "sparse_decode_v41": V41_DECODE},
    "v4_extra_empty": {"sparse_decode_v4": V4_DECODE, "sparse_decode_v41": V41_DECODE},
    "v4_zero_rope": {"sparse_decode_v4": V4_DECODE, "sparse_decode_v41": V41_DECODE},
    "v4_row_alone": {"sparse_decode_v4": V4_DECODE, "sparse_decode_v41": V41_DECODE},
    "determinism": {
        "sparse_prefill": PREFILL,
        "sparse_decode_fp8": DECODE,
        "forward_mqa": FORWARD,
        "dcp_merge": dict(ranks=4, tokens=256, heads=HEADS, empty_frac=0.3, junk=True),
    },
}


def production_cases(name: str, targets: list[str], seed: int = 0) -> list[Case]:
    """The pinned cases of property `name` on `targets`."""
    return [Case(PREFIX + name, {"target": t, **PINNED[name][t]}, seed) for t in targets]
