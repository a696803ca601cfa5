"""Compile the Triton attention kernels for an H200 (sm_90a) on any machine and report what the
compiler made of them: shared memory, registers, spills, wgmma vs mma.sync, cp.async copies, and
the SASS of the hottest loop (instructions a thread issues per iteration, and how many of them
are tensor-core ops and local-memory spill traffic).

    PYTHONPATH=. python3 scripts/kernel_resources.py

No GPU needed: the launchers run on meta tensors with each kernel swapped for a recorder, and
every recorded launch is compiled by `triton.compile` for cuda:90 and assembled with `ptxas -v`
(both ship with Triton). Pointers are taken as 16-byte aligned, integer arguments divisible by 16
are marked so and integers equal to 1 become constants, as Triton's launcher specializes them at
run time.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mla_verify.optimized.kernels import sparse_decode, sparse_prefill
from mla_verify.optimized.kernels.attention_launch import VARIANTS

TARGET = GPUTarget("cuda", 90, 32)
TYPES = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32", torch.uint8: "*u8"}
OPTIONS = ("num_warps", "num_stages")
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")  # ptxas, nvdisasm


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` records the call instead of launching."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.kernel, args, kwargs))


def compile_call(kernel, args, kwargs):
    values = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k not in OPTIONS}
    constexpr = {p.name for p in kernel.params if p.is_constexpr}
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        value = values[name]
        # The launcher also turns an integer argument equal to 1 into a constant (H=64: head_blocks).
        if name in constexpr or value is None or (type(value) is int and value == 1):
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name], attrs[(i,)] = TYPES[value.dtype], [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: kwargs[k] for k in OPTIONS if k in kwargs}
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=TARGET, options=options)


def hot_loop(cubin: bytes) -> str:
    """The longest backward branch's body in the SASS: instruction count, HGMMA, LDL/STL."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    ops, labels, loop = [], {}, []
    for line in sass.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(ops)
        elif m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?);", line):
            ops.append(m.group(1))
            if (b := re.search(r"BRA\s.*\((\.L_x_\d+)\)", m.group(1))) and b.group(1) in labels:
                loop = max(loop, ops[labels[b.group(1)]:], key=len)
    hgmma = sum("HGMMA" in op for op in loop)
    spills = sum("LDL" in op or "STL" in op for op in loop)
    return f"loop {len(loop):>5} instr, hgmma {hgmma:>3}, ldl/stl {spills:>3}"


def describe(compiled) -> str:
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run([os.path.join(BIN, "ptxas"), "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return (f"smem {compiled.metadata.shared:>6} B, {regs.group(1) if regs else '?':>3} regs, "
            f"spill {spill.group(1) if spill else '?':>4} B, wgmma {ptx.count('wgmma.mma_async'):>3}, "
            f"mma.sync {len(re.findall(r'mma.sync', ptx)):>3}, cp.async {len(re.findall(r'cp.async.c[ag]', ptx)):>3}; "
            f"{hot_loop(compiled.asm['cubin'])}")


def record(module, launch) -> list:
    calls: list = []
    kernels = [k for k in vars(module).values() if isinstance(k, triton.runtime.JITFunction)]
    saved = {k.__name__: k for k in kernels}
    try:
        for k in kernels:
            setattr(module, k.__name__, Recorder(k, calls))
        launch()
    finally:
        for attr, k in saved.items():
            setattr(module, attr, k)
    return calls


def main() -> None:
    meta = dict(device="meta")
    t, b, s, heads, topk, rows = 4096, 64, 2, 128, 2048, 32768
    q = torch.empty(t, heads, 576, dtype=torch.bfloat16, **meta)
    kv = torch.empty(rows, 576, dtype=torch.bfloat16, **meta)
    idx = torch.empty(t, topk, dtype=torch.int32, **meta)
    length = torch.empty(t, dtype=torch.int32, **meta)
    sink = torch.empty(heads, dtype=torch.float32, **meta)
    qd = torch.empty(b, s, heads, 576, dtype=torch.bfloat16, **meta)
    cache = torch.empty(4096, 64, 656, dtype=torch.uint8, **meta)
    idxd = torch.empty(b, s, topk, dtype=torch.int32, **meta)
    prefill = sparse_prefill.launch_sparse_prefill
    decode = sparse_decode.launch_sparse_decode_fp8
    cases = {
        "prefill": (sparse_prefill, "prefill", lambda cfg: prefill(q, kv, idx, 0.1, None, None, cfg)),
        "prefill+len+sink": (sparse_prefill, "prefill", lambda cfg: prefill(q, kv, idx, 0.1, length, sink, cfg)),
        "decode B=64 S=2": (sparse_decode, "decode", lambda cfg: decode(qd, cache, idxd, 0.1, cfg)),
        "decode B=1 split": (sparse_decode, "decode", lambda cfg: decode(qd[:1, :1], cache, idxd[:1, :1], 0.1, cfg)),
    }
    for label, (module, op, launch) in cases.items():
        for variant, cfg in VARIANTS[op].items():
            for kernel, args, kwargs in record(module, lambda: launch(cfg)):
                report = describe(compile_call(kernel, args, kwargs))
                print(f"{label:<18} {variant:<16} {kernel.__name__:<24} {report}", flush=True)


if __name__ == "__main__":
    main()
