"""What a case asks of the Triton interpreter, in seconds: the estimate that bounds CPU campaigns.

Under TRITON_INTERPRET=1 every program of a launch runs in Python, one block operation at a
time, so a kernel's time is its programs times its loop trips, nearly whatever a block holds (a
64-head block costs what a 1-head one does). The attention kernels are most of every case's cost;
a forward_mqa call adds a few programs per token (its index conversion, FP8 gather, HiSparse's
placement and swap-in). Measured on one Xeon core with triton 3.6, the kernels alone and the
rest as the remainder of whole HiSparse cases:

    sparse_prefill      PREFILL_PROGRAM_S per (token, head block) + BLOCK_S per 64-key block
    sparse_decode_fp8   DECODE_PROGRAM_S per (query row, head block, split) + BLOCK_S per key
                        block, each times DECODE_HEAD_BLOCK[block_h] (the decode's tiles are
                        dequantized for the whole head block: a 64-head block took 1.65x a
                        16-head one, measured at top-k 1024 on this project's 2-core machine,
                        triton 3.6), and COMBINE_S per (query row, head) when the top-k list is split
    sparse_decode_v4    UNION_PROGRAM_S per (query row, head block, split) + UNION_BLOCK_S per
                        block of either list (it dequantizes every row it loads), the head block's
                        weight and COMBINE_S as above
    forward_mqa         FORWARD_TOKEN_S per token and layer besides its attention

A case's estimate is its base problem's attention calls (`calls`) times the runs its check makes
of them (a property's `Target.runs`: determinism runs twice, split_invariance once per part and
once whole); it bounds the work from above (topk_length and invalid entries only shorten it).
"""

from __future__ import annotations

from dataclasses import dataclass

from mla_verify.optimized.kernels.attention_launch import NOMINAL_SMS, AttentionConfig, split_plan
from mla_verify.reference.metadata import reorder_batch_threshold, split_decodes_and_prefills

from .params import DecodeParams, ForwardParams, PrefillParams
from .schema import Params

PREFILL_PROGRAM_S = 0.006
DECODE_PROGRAM_S = 0.017   # it dequantizes the fp8 tile of every key block it loads
BLOCK_S = 0.008
COMBINE_S = 0.002
DECODE_HEAD_BLOCK = {16: 1.0, 32: 1.35, 64: 1.65}
FORWARD_TOKEN_S = 0.008
UNION_PROGRAM_S = 0.02     # measured: 2 programs of 10 blocks 0.45 s, 16 of 2 blocks 0.97 s
UNION_BLOCK_S = 0.02


@dataclass(frozen=True)
class Call:
    """One attention launch: `rows` query rows of `heads` heads over `topk` entries each."""

    kernel: str   # sparse_prefill | sparse_decode_fp8 | sparse_decode_v4 (V4.1 alike)
    rows: int
    heads: int
    topk: int

    def seconds(self) -> float:
        """The interpreter's time for this launch (module docstring)."""
        if self.rows <= 0 or self.topk <= 0:
            return 0.0
        cfg = AttentionConfig().resolve(self.heads, self.topk)
        head_blocks = -(-self.heads // cfg.block_h)
        if self.kernel == "sparse_prefill":
            blocks = -(-self.topk // cfg.block_n)
            return self.rows * head_blocks * (PREFILL_PROGRAM_S + BLOCK_S * blocks)
        splits, split_len = split_plan(self.topk, cfg.block_n, self.rows * head_blocks, NOMINAL_SMS, None)
        programs = self.rows * head_blocks * splits
        combine = self.rows * self.heads * COMBINE_S if splits > 1 else 0.0
        program_s, block_s = (UNION_PROGRAM_S, UNION_BLOCK_S) if self.kernel == "sparse_decode_v4" else (DECODE_PROGRAM_S, BLOCK_S)
        return programs * (program_s + block_s * (split_len // cfg.block_n)) * DECODE_HEAD_BLOCK[cfg.block_h] + combine


def _forward_calls(p: ForwardParams) -> list[Call]:
    """The attention launches of one forward_mqa call on batch `p` (every HiSparse layer)."""
    heads = p.heads * p.dcp_size  # DCP gathers every rank's heads
    tokens = sum(p.query_lens)
    qsl = [0]
    for n in p.query_lens:
        qsl.append(qsl[-1] + n)
    threshold = reorder_batch_threshold(p.heads, p.arch, max_decode_query_len=p.max_decode_query_len,
                                        dcp_size=p.dcp_size, interleave=p.interleave)
    decode_tokens = qsl[split_decodes_and_prefills(qsl, threshold).num_decodes]
    prefill_tokens = 0 if p.mqa == "decodes" else tokens - decode_tokens
    if p.cache_dtype == "bfloat16":
        calls = [Call("sparse_prefill", decode_tokens + prefill_tokens, heads, p.topk)]
    elif p.heads < 32 and not p.hisparse:  # the mixed FP8 path: every token through the decode kernel
        calls = [Call("sparse_decode_fp8", decode_tokens + prefill_tokens, heads, p.topk)]
    else:
        calls = [Call("sparse_decode_fp8", decode_tokens, heads, p.topk),
                 Call("sparse_prefill", prefill_tokens, heads, p.topk)]
    return calls * (p.layers if p.hisparse else 1)


def calls(params: Params) -> list[Call]:
    """The attention launches a case of these params poses once (none: an op without attention)."""
    if isinstance(params, PrefillParams):
        return [Call("sparse_prefill", params.tokens, params.heads, params.topk)]
    if isinstance(params, DecodeParams):
        return [Call("sparse_decode_fp8", params.batch * params.s_q, params.heads, params.topk)]
    if isinstance(params, ForwardParams):
        return _forward_calls(params)
    if hasattr(params, "extra_topk"):  # a union decode (equivalence.ops.v4): both lists in one launch
        return [Call("sparse_decode_v4", params.batch * params.s_q, params.heads, params.topk + params.extra_topk)]
    return []


def interpreted_s(params: Params, runs: int = 1) -> float:
    """Seconds the interpreter takes for `runs` runs of the problem `params` poses."""
    once = sum(c.seconds() for c in calls(params))
    if isinstance(params, ForwardParams):
        once += FORWARD_TOKEN_S * sum(params.query_lens) * (params.layers if params.hisparse else 1)
    return runs * once
