"""Time the sparse attention kernels at production shapes: FlashMLA against Triton launch variants.

    PYTHONPATH=/tmp/site:$PWD python3 scripts/bench_attention.py [--op prefill|decode|both] [--quick]

Prints one line per (shape, implementation): median kernel time (CUDA events through
triton.testing.do_bench, inputs already validated), TFLOP/s counted as
2 * tokens * heads * topk * (576 + 512), and for Triton the largest difference from FlashMLA's
output in bf16 ulps of FlashMLA's value and the largest lse difference. Triton variants are
`AttentionConfig` values: add one to `attention_launch.VARIANTS[op]` to time it. FlashMLA decode reuses one plan per
shape, as vLLM does across layers.
"""

from __future__ import annotations

import argparse

import torch
import triton

import reference
from optimized import flashmla
from optimized.kernels.attention_launch import VARIANTS, AttentionConfig
from optimized.kernels.sparse_decode import launch_sparse_decode_fp8
from optimized.kernels.sparse_prefill import launch_sparse_prefill

TOPK, SM_SCALE = 2048, 0.1352


def tflops(tokens: int, heads: int, ms: float) -> float:
    return 2 * tokens * heads * TOPK * (576 + 512) / (ms * 1e-3) / 1e12


def compare(out, lse, ref_out, ref_lse) -> str:
    if ref_out is None:
        return ""
    ulp = torch.finfo(torch.bfloat16).eps * ref_out.float().abs().clamp_min(2.0**-126)
    diff_out = float(((out.float() - ref_out.float()).abs() / ulp).max())
    live = torch.isfinite(ref_lse)
    diff_lse = float((lse - ref_lse).abs()[live].max())
    return f"  vs flash_mla: out {diff_out:.1f} ulp, lse {diff_lse:.2e}"


def run(label: str, tokens: int, heads: int, fn, reference_pair=None):
    result = fn()
    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    print(f"{label:<52} {ms * 1e3:9.1f} us {tflops(tokens, heads, ms):7.1f} TFLOP/s"
          + compare(result[0], result[1], *(reference_pair or (None, None))), flush=True)
    return result


def bench_prefill(quick: bool) -> None:
    fm_reason = flashmla.flash_mla_unavailable()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = 32768
    kv = (torch.randn(rows, 576, generator=g, device="cuda") / 4).bfloat16()
    for heads in (64, 128) if quick else (16, 64, 128):
        for tokens in (4096,) if quick else (1024, 4096, 16384):
            q = torch.randn(tokens, heads, 576, generator=g, device="cuda").bfloat16()
            idx = torch.randint(0, rows, (tokens, TOPK), generator=g, device="cuda", dtype=torch.int32)
            shape = f"prefill T={tokens} H={heads}"
            base = None
            if fm_reason is None:
                out, lse, _ = run(f"{shape} flash_mla", tokens, heads,
                                  lambda: flashmla.sparse_prefill(q, kv, idx, SM_SCALE))
                base = (out, lse)
            for name, cfg in VARIANTS["prefill"].items():
                run(f"{shape} triton[{name}]", tokens, heads,
                    lambda cfg=cfg: launch_sparse_prefill(q, kv, idx, SM_SCALE, None, None, cfg), base)
            del q, idx
    if fm_reason is not None:
        print(f"flash_mla not timed: {fm_reason}")


def bench_decode(quick: bool) -> None:
    fm_reason = flashmla.flash_mla_unavailable()
    g = torch.Generator(device="cuda").manual_seed(1)
    page, blocks = 64, 4096
    kv = (torch.randn(blocks * page, 576, generator=g, device="cuda") / 4).bfloat16()
    cache = reference.quantize_fp8_ds_mla(kv, "pow2").view(blocks, page, 656)
    rows_bf16 = reference.dequantize_fp8_ds_mla(cache.view(-1, 656))  # for the decode kernel minus its dequant
    for heads in (128,) if quick else (64, 128):
        for batch, s_q in ((1, 1), (64, 2), (128, 2)) if quick else (
            (1, 1), (8, 1), (32, 1), (64, 1), (64, 2), (128, 1), (128, 2)
        ):
            q = torch.randn(batch, s_q, heads, 576, generator=g, device="cuda").bfloat16()
            idx = torch.randint(0, blocks * page, (batch, s_q, TOPK), generator=g, device="cuda", dtype=torch.int32)
            shape = f"decode B={batch} S={s_q} H={heads}"
            base = None
            if fm_reason is None:
                import flash_mla

                sched, _ = flash_mla.get_mla_metadata()
                call = lambda: flash_mla.flash_mla_with_kvcache(  # noqa: E731
                    q, cache.unsqueeze(-2), None, None, 512, sched, softmax_scale=SM_SCALE,
                    is_fp8_kvcache=True, indices=idx, use_legacy=True)
                base = run(f"{shape} flash_mla", batch * s_q, heads, call)
            for name, cfg in VARIANTS["decode"].items():
                run(f"{shape} triton[{name}]", batch * s_q, heads,
                    lambda cfg=cfg: launch_sparse_decode_fp8(q, cache, idx, SM_SCALE, cfg), base)
            run(f"{shape} triton prefill on bf16 rows", batch * s_q, heads,
                lambda: launch_sparse_prefill(q.view(batch * s_q, heads, 576), rows_bf16,
                                              idx.view(batch * s_q, TOPK), SM_SCALE, None, None))
            if batch * s_q <= 16:
                run(f"{shape} triton[no split]", batch * s_q, heads,
                    lambda: launch_sparse_decode_fp8(q, cache, idx, SM_SCALE, AttentionConfig(num_splits=1)), base)
    if fm_reason is not None:
        print(f"flash_mla not timed: {fm_reason}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--op", choices=["prefill", "decode", "both"], default="both")
    parser.add_argument("--quick", action="store_true", help="the headline shapes only")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}")
    if args.op in ("prefill", "both"):
        bench_prefill(args.quick)
    if args.op in ("decode", "both"):
        bench_decode(args.quick)


if __name__ == "__main__":
    main()
