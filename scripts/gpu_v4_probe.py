"""What FlashMLA's legacy V4 sparse decode accepts, refuses and computes on this GPU: every
accepted call held to the reference's derived bound (tests.bound_checks.check_attention), then
FlashMLA and our Triton V4 decode timed at serving shapes. One line a probe; a table last.

    python3 scripts/gpu_v4_probe.py [OUT_DIR]
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import torch

from mla_verify import reference as R
from mla_verify.optimized import buffers, flashmla_v4
from mla_verify.optimized.kernels import union_decode
from tests.bound_checks import check_attention
from tests.test_triton_v4 import union_check_inputs
from tests.v4_inputs import decode_case

RESULTS: list[dict] = []


def cuda(kw: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def judge(label: str, fn, kw: dict, width: int) -> str:
    with buffers.poisoned():
        got = fn(**kw)
    torch.cuda.synchronize()
    main, extra = R.lists_of(kw)
    ref = R.sparse_decode_union(kw["q"], main, kw["sm_scale"], extra, kw["attn_sink"], magnitudes=True)
    nan = bool(got[0].isnan().any() or got[1].isnan().any())
    try:
        check_attention(label, *union_check_inputs(kw["q"], got, ref), width)
        verdict = "ok"
    except AssertionError as exc:
        verdict = f"WRONG: {str(exc).splitlines()[0][:150]}"
    err = (got[0].double() - ref.out).norm() / max(float((ref.out.bfloat16().double() - ref.out).norm()), 1e-30)
    return f"{verdict}; out error {float(err):.2f} bf16 roundings{'; NaN' if nan else ''}"


def probe(name: str, fn, **case) -> None:
    start = time.time()
    try:
        kw = cuda(decode_case(case.pop("seed", 0), **case))
        width = kw["indices"].shape[2] + (0 if kw["extra_indices"] is None else kw["extra_indices"].shape[2])
        outcome = "accepted: " + judge(name, fn, kw, width)
    except Exception as exc:  # a refusal is a finding
        outcome = f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    RESULTS.append({"probe": name, "outcome": outcome, "seconds": round(time.time() - start, 2)})
    print(f"{name:52s} {outcome}", flush=True)


def timed(fn, kw, reps=20) -> float:
    for _ in range(3):
        fn(**kw)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(**kw)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def save(out_dir: str, timing: list) -> None:
    with open(f"{out_dir}/gpu_v4_probe.json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "probes": RESULTS, "timing": timing}, f, indent=1)


def main(out_dir: str) -> None:
    fm, tv4 = flashmla_v4.launch_sparse_decode_v4, union_decode.sparse_decode_v4
    checked = flashmla_v4.sparse_decode_v4
    print(torch.cuda.get_device_name(), torch.__version__, "flash_mla:", flashmla_v4.flash_mla_unavailable() or "ok")
    base = dict(batch=4, s_q=1, heads=64, topk=128, extra_topk=512, block=64, extra_block=64, sink="inf")
    # Our Triton kernels are fuzzed by scripts/gpu_v4.sh's triton step; here FlashMLA's own answers.
    probe("flash_mla h64 b4 s1 128+512 lengths random", checked, **base)
    probe("flash_mla h128 b2 s4 128+512 MTP", checked, **dict(base, heads=128, batch=2, s_q=4, seed=1))
    probe("flash_mla h16 (padded) b3 s2", checked, **dict(base, heads=16, batch=3, s_q=2, seed=2))
    probe("flash_mla no extra cache", checked, **dict(base, extra_fmt=None, seed=4))
    probe("flash_mla lengths 0/1/full both lists", checked, **dict(base, lengths="edges", extra_lengths="edges", seed=3))
    probe("flash_mla no lengths, -1 at 30%", checked, **dict(base, lengths="none", extra_lengths="none",
                                                             invalid_rate=0.3, seed=5))
    probe("flash_mla pages gapped 16 B", checked, **dict(base, gap=16, seed=6))
    probe("flash_mla extra_topk 100 (wrapper pads with -1)", checked, **dict(base, extra_topk=100, seed=8))
    for block in (1, 2, 5, 53, 61, 69, 123, 576):
        probe(f"flash_mla main block {block}, extra block {block}", checked,
              **dict(base, block=block, extra_block=block, seed=10 + block))

    # Per-token lengths where FlashMLA takes them per request: refused or read as what?
    kw = cuda(decode_case(30, **dict(base, s_q=2)))
    try:
        fm(**dict(kw, topk_length=kw["topk_length"].repeat_interleave(2)))
        RESULTS.append({"probe": "flash_mla raw: topk_length per token [B*S]", "outcome": "accepted"})
    except Exception as exc:
        RESULTS.append({"probe": "flash_mla raw: topk_length per token [B*S]",
                        "outcome": f"refused: {str(exc).splitlines()[0][:160]}"})
    print(RESULTS[-1])
    # Determinism, and a row alone against the same row in a batch.
    kw = cuda(decode_case(31, **dict(base, batch=8)))
    a, b = checked(**kw), checked(**kw)
    alone = checked(**{k: (v[:1] if isinstance(v, torch.Tensor) and k in ("q", "indices", "extra_indices",
                                                                          "topk_length", "extra_topk_length") else v)
                       for k, v in kw.items()})
    RESULTS.append({"probe": "flash_mla run twice bitwise / row alone vs in a batch of 8",
                    "outcome": f"{torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])} / "
                               f"max |diff| {float((alone[0][0].float() - a[0][0].float()).abs().max()):.3g}"})
    print(RESULTS[-1])

    timing = []
    for heads in (64, 128):
        for batch in (64, 128):
            kw = cuda(decode_case(40, batch=batch, s_q=4, heads=heads, topk=128, extra_topk=512, block=256,
                                  extra_block=64, lengths="none", extra_lengths="random", invalid_rate=0.0))
            flops = 2 * batch * 4 * heads * 640 * 1024
            t_f, t_t = timed(fm, kw), timed(tv4, kw)
            timing.append({"heads": heads, "batch": batch, "flash_mla_us": round(t_f, 1), "triton_us": round(t_t, 1),
                           "flash_mla_tflops": round(flops / t_f / 1e6, 1), "triton_tflops": round(flops / t_t / 1e6, 1)})
            print(timing[-1], flush=True)
    save(out_dir, timing)
    # Last: what FlashMLA's own checks may not catch (a partial block read past its row could take
    # the CUDA context down with it, and every later call).
    probe("flash_mla raw: topk 64 with an extra cache", fm, **dict(base, topk=64, seed=9))
    probe("flash_mla raw: extra_topk 100 (partial block) h128", fm, **dict(base, heads=128, extra_topk=100, seed=7))
    probe("flash_mla raw: extra_topk 100 (partial block) h64", fm, **dict(base, extra_topk=100, seed=8))
    probe("flash_mla raw: topk 100 (partial main block)", fm, **dict(base, topk=100, seed=9))
    probe("flash_mla raw: pages gapped 8 B (not 16-aligned)", fm, **dict(base, gap=8, seed=6))
    save(out_dir, timing)
    print("\nprobe | outcome")
    for r in RESULTS:
        print(f"{r['probe'][:50]:50s} | {r['outcome'][:120]}")
    print("\nV4 decode s_q 4, 128 + 512 (us, TFLOP/s): " + "; ".join(
        f"h{t['heads']} b{t['batch']}: flash_mla {t['flash_mla_us']} ({t['flash_mla_tflops']}), triton "
        f"{t['triton_us']} ({t['triton_tflops']})" for t in timing))


if __name__ == "__main__":
    try:
        main(sys.argv[1] if len(sys.argv) > 1 else ".")
    except Exception:
        traceback.print_exc()
        sys.exit(3)
