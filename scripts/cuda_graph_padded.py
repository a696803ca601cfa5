"""Issue 48's question for property:cuda_graph's padded replay, asked of the GPU: a decode captured in
a CUDA graph at batch B on static buffers, then replayed on b < B real requests whose last B - b
rows are vLLM's padding (every index -1, the query whatever the buffer held): are the real rows bit
for bit what an eager call gives on the padded problem, and what an eager call on the b real rows
alone gives; do the padding rows hold out 0 and lse +inf? For flash_mla and our Triton decode,
B = 1x, 2x, 4x the real batch (and the issue's 8 for 5), s_q 1 and 2, 64 and 128 heads.

    python3 scripts/cuda_graph_padded.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mla_verify import reference as R  # noqa: E402
from mla_verify.optimized import flashmla  # noqa: E402
from mla_verify.optimized.kernels import sparse_decode  # noqa: E402

SM_SCALE, TOPK, BLOCKS, PAGE = 0.1352, 2048, 1024, 64


def problem(gen: torch.Generator, real: int, batch: int, s_q: int, heads: int, cache: torch.Tensor):
    """(q, indices) of `batch` rows: `real` requests of random slots, the rest padding (-1 indices,
    random queries: a persistent buffer holds whatever the last step left)."""
    q = torch.randn(batch, s_q, heads, 576, generator=gen, device="cuda").bfloat16()
    idx = torch.randint(0, BLOCKS * PAGE, (batch, s_q, TOPK), generator=gen, device="cuda", dtype=torch.int32)
    idx[real:] = -1
    return q, idx


def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32),
                                              b.contiguous().view(torch.int16 if b.element_size() == 2 else torch.int32))


def probe(name: str, launch, real: int, batch: int, s_q: int, heads: int, cache: torch.Tensor, gen) -> str:
    static_q, static_idx = problem(gen, real, batch, s_q, heads, cache)
    launch(static_q, cache, static_idx, SM_SCALE)  # warm-up: compilation, plans
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch(static_q, cache, static_idx, SM_SCALE)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = launch(static_q, cache, static_idx, SM_SCALE)
    verdicts = []
    for _ in range(3):  # new problems copied into the captured buffers
        q, idx = problem(gen, real, batch, s_q, heads, cache)
        static_q.copy_(q)
        static_idx.copy_(idx)
        graph.replay()
        out, lse = (t.clone() for t in captured)
        eager_out, eager_lse = launch(q, cache, idx, SM_SCALE)
        alone_out, alone_lse = launch(q[:real].contiguous(), cache, idx[:real].contiguous(), SM_SCALE)
        ref = R.sparse_decode_fp8(q[:real], cache, idx[:real], SM_SCALE)
        worst = (out[:real].double() - ref.out).abs().max().item()
        verdicts.append((equal(out[:real], eager_out[:real]) and equal(lse[:real], eager_lse[:real]),
                         equal(out[:real], alone_out) and equal(lse[:real], alone_lse),
                         bool((out[real:] == 0).all()) and bool((lse[real:] == float("inf")).all()),
                         (out[:real].float() - alone_out.float()).abs().max().item(), worst))
    padded, alone, empty, drift, worst = zip(*verdicts)
    return (f"{name:9s} b={real} B={batch:2d} s_q={s_q} H={heads:3d}: replay == eager padded {all(padded)}; "
            f"== eager on the b real rows {all(alone)} (max |diff| {max(drift):.3g}); padding out 0 / lse +inf "
            f"{all(empty)}; max |replay - reference| {max(worst):.3g}")


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    kv = (torch.randn(BLOCKS * PAGE, 576, generator=gen, device="cuda") / 4).bfloat16()
    cache = R.quantize_fp8_ds_mla(kv, "pow2").view(BLOCKS, PAGE, 656)
    launches = {"triton": sparse_decode.launch_sparse_decode_fp8}
    if flashmla.flash_mla_unavailable() is None:
        launches["flash_mla"] = flashmla.launch_sparse_decode_fp8
    shapes = [(5, 8, 1, 128)] + [(real, real * m, s_q, heads) for real in (5, 3) for m in (1, 2, 4) for s_q in (1, 2)
                                 for heads in (64, 128)]
    for name, launch in launches.items():
        for real, batch, s_q, heads in shapes:
            try:
                print(probe(name, launch, real, batch, s_q, heads, cache, gen), flush=True)
            except Exception as exc:  # one shape's failure is a line of the answer
                print(f"{name} b={real} B={batch} s_q={s_q} H={heads}: {type(exc).__name__}: {exc}"[:300], flush=True)


if __name__ == "__main__":
    main()
