"""The Triton V4 decode fits an SM90's shared memory (227 KiB a block) at every head tile its
launcher picks by default: compiled for sm_90a on this CPU machine with Triton's own compiler and
ptxas (`scripts/kernel_resources.py`), no GPU needed. On the H100 the 16-head tile at 64 rows a
step asked for 246,272 B and every such case failed with OutOfResources."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SM90_SHARED = 232448  # bytes a block may use on an H100 / H200 (cudaDevAttrMaxSharedMemoryPerBlockOptin)

SCRIPT = """
import sys, torch
sys.path.insert(0, "scripts")
import kernel_resources as kr
from mla_verify.optimized import buffers
from mla_verify.optimized.kernels import launch, union_decode as ud
from mla_verify.optimized.v4_formats import V4, V41, V41_FP4

ud.native = lambda device: True  # meta tensors: nothing runs, the launch is recorded and compiled
buffers.empty = lambda shape, dtype, device: torch.empty(shape, dtype=dtype, device="meta")
m = dict(device="meta")
for heads, topk, xtopk, fmt, xfmt in [(16, 64, 0, V4, None), (32, 64, 0, V4, None), (64, 128, 512, V4, V4),
                                      (16, 128, 512, V41, V41_FP4)]:
    cache = lambda f: torch.empty(8, 64, f.data_bytes + f.scale_bytes, dtype=torch.uint8, **m)
    lists = lambda k: torch.empty(2, 1, k, dtype=torch.int32, **m)
    main = ud.UnionList(cache(fmt), lists(topk), torch.empty(2, dtype=torch.int32, **m), fmt)
    extra = ud.UnionList(cache(xfmt), lists(xtopk), None, xfmt) if xtopk else None
    q = torch.empty(2, 1, heads, 512, dtype=torch.bfloat16, **m)
    calls = kr.record(ud, lambda: ud.launch_union_decode(q, main, extra, 0.1, None))
    kernel, args, kwargs = next(c for c in calls if c[0].__name__ == "_union_decode_kernel")
    print(heads, topk, xtopk, kr.compile_call(kernel, args, kwargs).metadata.shared)
"""


def test_the_v4_decode_fits_sm90_shared_memory_at_every_default_tile():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = {tuple(map(int, line.split()[:3])): int(line.split()[3]) for line in done.stdout.splitlines()}
    assert len(sizes) == 4, done.stdout
    assert all(0 < size <= SM90_SHARED for size in sizes.values()), sizes
