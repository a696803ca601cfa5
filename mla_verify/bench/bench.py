"""`mla-verify bench`: how fast the kernels, the reference and the harness itself are.

On a GPU, per path and production shape (DeepSeek V3.2: topk 2048, 576/512, page 64; 128 heads
per rank down to 16; decode batch 1-128 with s_q 1 and 2; prefill 1k-16k tokens):
  kernels    median time over rotated input sets (CUDA events around each call, after warm-up),
             TFLOP/s and GB/s against the measured ceilings; FlashMLA called standalone and
             through our wrapper side by side (their ratio must stay within 5%), our Triton kernels
  reference  float64 prefill H=128 topk 2048 at T = 4k, 16k, 64k streamed under the reference
             memory budget (`--reference-memory`), and at 16k collected whole: time, peak memory
  harness    per compared case (decode B=64 s_q=2 H=128), evaluated alone (block 1, as before
             blocks) and in a block of 8 cases of its params: total time minus the reference's and
             the kernel's, over their sum, and the float64 reference's TFLOP/s; then stage by stage
             (inputs, snapshot of the inputs taken and compared back, kernel, reference, judge):
             time, aten ops, reads back to the host, CUDA launches (profiler), per case
  fuzz       cases per second, decode-sized cases of the `gpu` profile, float64 reference on the
             device, drawn one case an example and 8 (blocks), judged in-process and isolated (the
             worker started off the clock); per case: drawing it, the reference, the kernel, inputs
             and judging; then 4 campaigns at once sharing the GPU (`--parallel 4` on one GPU),
             each process started and warmed up off the clock
  guards     (CPU and GPU) each guard's cost per case in ms, and isolation's (`mla_verify.bench.guard_bench`)
  history    (CPU and GPU) `mla-verify history` over 200 runs of 5,000 rows (`mla_verify.bench.history_bench`)
On a CPU: the reference at a 128k-token context and a 1024-token prefill streamed under 256 MiB
(time, peak RSS in fresh processes), harness overhead with its stages, and fuzz
throughput of the `ci` profile. `--only` picks sections. Prints a table last; writes JSON.

FLOPs = 2 * rows * heads * topk * (576 + 512), rows = T (prefill) or B * s_q (decode).
Minimal bytes = q + indices + each distinct gathered row once + out (+ lse).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

TOPK, SM_SCALE, PAGE = 2048, 0.1352, 64
BF16_CEILING_TFLOPS = 790.0   # 8192^3 bf16 matmul on this workplace's H200 (device/KINDS.md)
HBM_CEILING_GBS = 4300.0      # device-to-device copy, bytes read + written (device/KINDS.md)
ROTATIONS = 3                 # input sets cycled so no call finds the last one's rows in L2
BLOCK = 8                     # cases a block holds in the harness section's "after" (the gpu profile's)
PARTS = 4                     # campaigns sharing the GPU in the harness section's last rows (--parallel 4)


def flops(rows: int, heads: int, topk: int = TOPK) -> float:
    return 2.0 * rows * heads * topk * (576 + 512)


def _median_ms(fns: dict[str, tuple], reps: int) -> dict[str, float]:
    """name -> (fn, input sets): median milliseconds of one call each, the implementations
    interleaved call by call so clock and thermal drift fall on all of them alike."""
    for fn, inputs in fns.values():  # warm-up: compilation, plans, allocator
        for args in inputs:
            fn(*args)
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(reps):
        for name, (fn, inputs) in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*inputs[i % len(inputs)])
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def _row(kind: str, shape: str, impl: str, ms: float, fl: float, nbytes: float, **extra) -> dict:
    row = {"kind": kind, "shape": shape, "impl": impl, "ms": ms, "tflops": fl / ms / 1e9,
           "gbs": nbytes / ms / 1e6, "pct_peak": 100 * fl / ms / 1e9 / BF16_CEILING_TFLOPS, **extra}
    print(json.dumps(row), flush=True)  # progress, and what survives if a later step dies
    return row


def _prefill_inputs(tokens: int, heads: int, rows: int, gen: torch.Generator):
    kv = (torch.randn(rows, 576, generator=gen, device="cuda") / 4).bfloat16()
    sets = []
    for _ in range(ROTATIONS):
        q = torch.randn(tokens, heads, 576, generator=gen, device="cuda").bfloat16()
        idx = torch.randint(0, rows, (tokens, TOPK), generator=gen, device="cuda", dtype=torch.int32)
        sets.append((q, kv, idx))
    nbytes = tokens * heads * (576 + 512) * 2 + tokens * TOPK * 4 + min(rows, tokens * TOPK) * 576 * 2
    return sets, nbytes


def _decode_inputs(batch: int, s_q: int, heads: int, blocks: int, gen: torch.Generator):
    from mla_verify import reference

    kv = (torch.randn(blocks * PAGE, 576, generator=gen, device="cuda") / 4).bfloat16()
    cache = reference.quantize_fp8_ds_mla(kv, "pow2").view(blocks, PAGE, 656)
    sets = []
    for _ in range(ROTATIONS):
        q = torch.randn(batch, s_q, heads, 576, generator=gen, device="cuda").bfloat16()
        idx = torch.randint(0, blocks * PAGE, (batch, s_q, TOPK), generator=gen, device="cuda", dtype=torch.int32)
        sets.append((q, cache, idx))
    rows = batch * s_q
    nbytes = rows * heads * (576 + 512) * 2 + rows * TOPK * 4 + min(blocks * PAGE, rows * TOPK) * 656
    return sets, nbytes


def _kernel_rows(shape: str, fl: float, nbytes: float, fns: dict[str, tuple], reps: int) -> list[dict]:
    ms = _median_ms(fns, reps)
    base = ms.get("flash_mla standalone")
    rows = []
    for name, t in ms.items():
        extra = {}
        if name == "flash_mla via mla-verify":
            extra["vs_standalone"] = t / base
        elif name.startswith("triton") and base:
            extra["vs_flash_mla"] = base / t
        rows.append(_row("kernel", shape, name, t, fl, nbytes, **extra))
    return rows


def bench_kernels(quick: bool, reps: int) -> list[dict]:
    from mla_verify import adapters
    from mla_verify.optimized import flashmla
    from mla_verify.optimized.kernels import sparse_decode, sparse_prefill
    from mla_verify.optimized.kernels.attention_launch import VARIANTS

    have_fm = flashmla.flash_mla_unavailable() is None
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    prefill = [(4096, 128), (4096, 64)] if quick else [(t, h) for h in (128, 64, 32, 16) for t in (1024, 4096, 16384)]
    for tokens, heads in prefill:
        sets, nbytes = _prefill_inputs(tokens, heads, 65536, gen)
        fns = {f"triton[{name}]": (lambda q, kv, i, cfg=cfg: sparse_prefill.launch_sparse_prefill(q, kv, i, SM_SCALE, None, None, cfg), sets)
               for name, cfg in VARIANTS["prefill"].items()}
        if have_fm:
            import flash_mla

            raw = [(adapters.pad_heads(q, 0.0), kv.unsqueeze(1), idx.unsqueeze(1)) for q, kv, idx in sets]
            fns["flash_mla standalone"] = (lambda q, kv, i: flash_mla.flash_mla_sparse_fwd(q, kv, i, SM_SCALE, use_legacy=True), raw)
            fns["flash_mla via mla-verify"] = (lambda q, kv, i: flashmla.launch_sparse_prefill(q, kv, i, SM_SCALE), sets)
        out += _kernel_rows(f"prefill T={tokens} H={heads}", flops(tokens, heads), nbytes, fns, reps)
        del sets, fns
    decode = [(64, 1, 128), (128, 2, 128), (64, 2, 64)] if quick else [
        (b, s, h) for h in (128, 64, 32, 16) for s in (1, 2) for b in (1, 8, 32, 64, 128)]
    for batch, s_q, heads in decode:
        sets, nbytes = _decode_inputs(batch, s_q, heads, 8192, gen)
        fns = {f"triton[{name}]": (lambda q, c, i, cfg=cfg: sparse_decode.launch_sparse_decode_fp8(q, c, i, SM_SCALE, cfg), sets)
               for name, cfg in VARIANTS["decode"].items()}
        if have_fm:
            import flash_mla

            plan = flash_mla.get_mla_metadata()[0]
            raw = [(adapters.pad_heads(q, 0.0), c.unsqueeze(-2), i) for q, c, i in sets]
            fns["flash_mla standalone"] = (lambda q, c, i: flash_mla.flash_mla_with_kvcache(
                q, c, None, None, 512, plan, softmax_scale=SM_SCALE, is_fp8_kvcache=True, indices=i, use_legacy=True), raw)
            fns["flash_mla via mla-verify"] = (lambda q, c, i: flashmla.launch_sparse_decode_fp8(q, c, i, SM_SCALE), sets)
        out += _kernel_rows(f"decode B={batch} s_q={s_q} H={heads}", flops(batch * s_q, heads), nbytes, fns, reps)
        del sets, fns
    return out


def bench_reference_gpu(quick: bool, budget: int) -> list[dict]:
    """The float64 reference, prefill H=128 topk 2048 at T = 4k, 16k, 64k, streamed under the
    memory budget (peak = working memory beyond the inputs); at 16k also collected into the whole
    result (float64 and float32: peak = the result + working memory)."""
    from mla_verify import reference

    gen = torch.Generator(device="cuda").manual_seed(1)
    kv = torch.randn(65536, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    q0 = torch.randn(2, 128, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    reference.sparse_prefill(q0, kv, torch.zeros(2, TOPK, dtype=torch.int32, device="cuda"), SM_SCALE)  # cuBLAS set-up
    runs = [(4096, "streamed", torch.float64)] if quick else [
        (4096, "streamed", torch.float64), (16384, "streamed", torch.float64), (65536, "streamed", torch.float64),
        (16384, "whole result", torch.float64), (16384, "whole result", torch.float32)]
    out = []
    for tokens, form, dtype in runs:
        q = torch.randn(tokens, 128, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
        idx = torch.randint(0, 65536, (tokens, TOPK), generator=gen, device="cuda", dtype=torch.int32)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        if form == "streamed":
            for _rows, _part in reference.sparse_prefill_chunks(q, kv, idx, SM_SCALE, dtype=dtype, budget_bytes=budget):
                pass
        else:
            reference.sparse_prefill(q, kv, idx, SM_SCALE, dtype=dtype, budget_bytes=budget)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        row = {"kind": "reference", "shape": f"prefill T={tokens} H=128", "impl": f"reference {str(dtype)[6:]} {form}",
               "ms": seconds * 1e3, "tflops": flops(tokens, 128) / seconds / 1e12,
               "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30, "budget_gib": budget / 2**30}
        print(json.dumps(row), flush=True)
        out.append(row)
        del q, idx
    return out


class OpCounter(TorchDispatchMode):
    """Counts the aten ops a block dispatches (views excluded: they launch nothing) and those
    that read a device value back to the host (each a sync on a GPU)."""

    READS_BACK = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select"}

    def __init__(self):
        super().__init__()
        self.ops = self.reads_back = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            self.ops += 1
        to_host = (name in ("_to_copy", "copy_") and isinstance(result, torch.Tensor) and result.device.type == "cpu"
                   and any(isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in (*args, *kwargs.values())))
        if name in self.READS_BACK or to_host:
            self.reads_back += 1
        return result


def _launches(fn) -> int:
    """CUDA kernel launches, memcpys and memsets of fn(), counted from the profiler's runtime and
    driver API events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "LaunchKernel" in e.name or e.name.startswith(("cudaMemcpy", "cudaMemset")))


def stage_profile(case, subject, device: str, count: int = 1) -> dict[str, dict]:
    """Where one evaluated case's time goes, stage by stage (inputs, snapshot, kernel, reference,
    judge), in a block of `count` cases of its params as `OpSpec.evaluate_block` runs them (the
    reference once for the block, after its calls; each check judged at once): median ms per case
    of 3 runs, aten ops dispatched, reads back to the host, and on a GPU launches, per case. The snapshot stage
    copies the inputs and compares them back, as a block does (one read back for all its cases)."""
    from mla_verify.equivalence.catalog import get_spec
    from mla_verify.equivalence.sandbox.call_guards import Snapshot, changed_together
    from mla_verify.equivalence.judge.oracle import judge_many
    from mla_verify.equivalence.sandbox.calls import timed
    from mla_verify.optimized.buffers import poisoned

    spec = get_spec(case.op)
    params = spec.params_of(case.params)
    seeds = [case.seed + i for i in range(count)]
    state: dict = {}

    def inputs():
        state["kw"] = [spec.inputs(params, seed, device) for seed in seeds]

    def ref():
        state["ref"] = spec._answer(state["kw"], params)

    def snapshot():
        changed_together([Snapshot(kw) for kw in state["kw"]], spec.writes)

    def kernel():
        with poisoned():
            state["got"] = [spec.call(subject, kw, params) for kw in state["kw"]]

    def judged():
        answer, everyone = state["ref"], range(count)
        for check in spec.checks:
            bounds = {dev: answer.of(name, everyone) for dev, name in (check.bounds_in(answer.names()) or {}).items()}
            judge_many(check.kind, [got.tensors[check.tensor] for got in state["got"]], answer.of(check.tensor, everyone),
                       params.numerics(), state["got"][0].deviations, answer.of(check.scale, everyone), bounds or None)

    stages = {"inputs": inputs, "snapshot": snapshot, "kernel": kernel, "reference": ref, "judge": judged}
    times: dict[str, list[float]] = {name: [] for name in stages}
    for _ in range(3):
        for name, fn in stages.items():
            times[name].append(timed(fn, device)[1])
    out = {}
    for name, fn in stages.items():
        counter = OpCounter()
        with counter:
            fn()
        out[name] = {"ms": statistics.median(times[name]) * 1e3 / count, "ops": counter.ops / count,
                     "reads_back": counter.reads_back / count,
                     "launches": _launches(fn) / count if device == "cuda" else None}
    return out


def harness_case(device: str):
    """The production-sized case the harness and guards sections time: decode B=64 s_q=2 H=128
    topk 2048 on a GPU, B=2 H=16 topk 256 on a CPU, built by the current input builder."""
    from mla_verify.equivalence.cases.builders import CURRENT
    from mla_verify.equivalence.cases.case import Case

    if device == "cuda":
        heads, batch, seq = 128, 64, 8192
    else:
        heads, batch, seq = 16, 2, 2048
    return Case("sparse_decode_fp8", {"batch": batch, "s_q": 2, "heads": heads, "topk": TOPK if device == "cuda" else 256,
                                      "seq_lens": [seq] * batch, "page_size": PAGE, "stride_pad": 0,
                                      "value_regime": "normal", "scale_rule": "pow2", "sm_scale": SM_SCALE,
                                      "invalid": [], "inputs": CURRENT}, 7)


def _evaluated(case, subject, device: str, count: int) -> dict[str, float]:
    """One block of `count` cases of `case`'s params (successive seeds) through `evaluate_block`,
    median of 3 after a warm-up: per case, its total, reference and kernel seconds."""
    from mla_verify.equivalence.cases.case import Case
    from mla_verify.equivalence.catalog import evaluate_block

    cases = [Case(case.op, case.params, case.seed + i) for i in range(count)]
    evaluate_block(cases, subject, device)  # compilation, plans, row pools
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        found = evaluate_block(cases, subject, device)
        total = time.perf_counter() - start
        runs.append((total, sum(rows[0].time_ref_s for rows in found), sum(rows[0].time_impl_s for rows in found)))
    total, ref, kernel = (statistics.median(x) / count for x in zip(*runs))
    return {"total": total, "reference": ref, "kernel": kernel}


def _throughput(subject, device: str, profile, examples: int, block: int, isolated: bool = False, seed: int = 3,
                ready=lambda: None) -> dict:
    """A fuzz campaign of `examples` drawn sparse_decode_fp8 cases (no shrinking, no covering set:
    its cases run one at a time, whatever the block) in blocks of `block`, judged in
    this process or (`isolated`) produced in an isolation worker, started and warmed up before
    the clock starts (`ready()` just before), and judged here: cases/s and the time per case
    split into drawing it, the reference, the kernel and the rest (inputs, snapshots, judging;
    isolated: the worker's side too)."""
    from mla_verify.equivalence.blocks import Judging
    from mla_verify.equivalence.judge.rows import RowContext
    from mla_verify.fuzz.campaign import Campaign, fuzz

    spent = {"evaluate": 0.0, "reference": 0.0, "kernel": 0.0}
    judging, context = Judging(device, isolated), RowContext(label=subject.label, device=device)
    if isolated:
        judging.case(harness_case(device), subject, context)  # its start-up and warm-up, off the clock

    def account(found, seconds):
        spent["evaluate"] += seconds
        for rows in filter(None, found):
            spent["reference"] += rows[0].time_ref_s
            spent["kernel"] += rows[0].time_impl_s if rows[0].time_impl_s == rows[0].time_impl_s else 0.0  # NaN: it raised
        return found

    def run_block(cases, source, on_call):
        start = time.perf_counter()
        found = judging.block(cases, subject, replace(context, source=source, on_call=on_call))
        return account(found, time.perf_counter() - start)

    try:
        ready()
        start = time.perf_counter()
        result = fuzz(Campaign("sparse_decode_fp8", profile, examples, seed, block=block, shrink=False, covering=False),
                      run_block)
        elapsed = time.perf_counter() - start
    finally:
        judging.close()
    n = max(result.examples, 1)
    per_case = {"draw": elapsed - spent["evaluate"], "reference": spent["reference"], "kernel": spent["kernel"],
                "inputs_judge": spent["evaluate"] - spent["reference"] - spent["kernel"]}
    how = "isolated" if isolated else "in-process"
    return {"kind": "fuzz", "shape": f"sparse_decode_fp8, profile {profile.name}", "impl": f"{subject.label}, {how}, block {block}",
            "cases_per_s": result.examples / elapsed, "cases": result.examples, "seconds": elapsed,
            "per_case_ms": {k: v / n * 1e3 for k, v in per_case.items()},
            "ops_note": "per case: " + ", ".join(f"{k} {v / n * 1e3:.1f} ms" for k, v in per_case.items())}


@dataclass(frozen=True)
class _Part:
    """One of `parallel_throughput`'s campaigns: its seed and its share of the cores and the GPU."""

    device: str
    profile_name: str
    examples: int
    block: int
    isolated: bool
    seed: int
    threads: int
    share: float


def _part(part: _Part, go, results) -> None:
    """One of `parallel_throughput`'s processes: warmed up, it says so and waits for `go`, then
    runs its campaign."""
    from mla_verify.equivalence.catalog import resolve_subject
    from mla_verify.equivalence.sandbox.device import GPU_SHARE_ENV, WORKER_SHARE, take_gpu_share
    from mla_verify.equivalence.cases.profiles import get_profile

    torch.set_num_threads(part.threads)
    os.environ[GPU_SHARE_ENV] = f"{part.share:.6f}"  # as `--parallel` deals a part: its worker reads it too
    take_gpu_share(1 - WORKER_SHARE if part.isolated else 1.0)
    subject, profile = resolve_subject("sparse_decode_fp8", [], part.device), get_profile(part.profile_name)
    _throughput(subject, part.device, profile, 2 * part.block, part.block, False, part.seed)  # compilation, plans, row pools

    def ready() -> None:
        results.put(None)
        go.wait()

    results.put(_throughput(subject, part.device, profile, part.examples, part.block, part.isolated, part.seed,
                            ready=ready))


def _gather(results, procs, count: int) -> list:
    """`count` messages from the parts, or RuntimeError as soon as one of them died."""
    import queue

    found: list = []
    while len(found) < count:
        try:
            found.append(results.get(timeout=1))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"a part died: exit codes {[p.exitcode for p in procs]}") from None
    return found


def parallel_throughput(device: str, profile_name: str, examples: int, block: int, parts: int,
                        isolated: bool) -> dict:
    """`parts` campaigns at once on this host's GPU (as `--parallel` runs them past the GPU count:
    seeds 3, 4, ..., each with its share of the cores, of the GPU's memory and of the examples),
    every process started and warmed up off the clock: cases/s of them together, from the moment
    they all start to the last one's end."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # this process holds a CUDA context: no fork
    go, results = ctx.Event(), ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // parts)
    if device == "cuda":
        torch.cuda.empty_cache()  # what the sections before cached is the parts' to take
    procs = [ctx.Process(target=_part, args=(_Part(device, profile_name, examples // parts, block, isolated, 3 + i,
                                                  threads, 1 / parts), go, results)) for i in range(parts)]
    for p in procs:
        p.start()
    try:
        _gather(results, procs, parts)
        start = time.perf_counter()
        go.set()
        found = _gather(results, procs, parts)
        elapsed = time.perf_counter() - start
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    cases = sum(r["cases"] for r in found)
    how = "isolated" if isolated else "in-process"
    where = " on one GPU" if device == "cuda" else ""
    return {"kind": "fuzz", "shape": f"sparse_decode_fp8, profile {profile_name}",
            "impl": f"{found[0]['impl'].split(',')[0]}, {parts} parts {how}, block {block}",
            "cases_per_s": cases / elapsed, "cases": cases, "seconds": elapsed,
            "ops_note": f"{parts} processes{where}, {threads} threads each; "
                        f"slowest part {max(r['seconds'] for r in found):.2f} s"}


def bench_harness(device: str, profile_name: str, examples: int) -> list[dict]:
    """Before and after blocks, in one process: harness overhead per compared case and where its
    time goes, evaluated alone (block 1: as before blocks) and in a block of BLOCK cases of its
    params, with the float64 reference's TFLOP/s; then fuzz throughput of the profile drawn one
    case an example and BLOCK cases an example, judged in this process and isolated (the default
    of a named implementation: `mla-verify fuzz` as users run it), and PARTS such campaigns at
    once on the one GPU."""
    from mla_verify.equivalence.catalog import resolve_subject
    from mla_verify.equivalence.cases.profiles import get_profile

    out: list[dict] = []

    def emit(row: dict) -> None:
        out.append(row)
        print(json.dumps(row), flush=True)  # progress, and what survives if a later step dies

    case = harness_case(device)
    p = case.params
    subject = resolve_subject("sparse_decode_fp8", [], device)
    shape = f"decode B={p['batch']} s_q={p['s_q']} H={p['heads']}"
    fl = flops(p["batch"] * p["s_q"], p["heads"], p["topk"])
    for count in (1, BLOCK):
        t = _evaluated(case, subject, device, count)
        try:
            stages = stage_profile(case, subject, device, count)
        except Exception as exc:  # a profiler that cannot run here costs the breakdown, not the bench
            print(f"stage profile failed: {type(exc).__name__}: {exc}", flush=True)
            stages = {}
        inner = t["reference"] + t["kernel"]
        emit({"kind": "harness", "shape": shape, "impl": f"{subject.label}, block {count}",
              "ms": t["total"] * 1e3, "overhead_pct": 100 * (t["total"] - inner) / inner,
              "inputs_ms": stages.get("inputs", {}).get("ms"), "snapshot_ms": stages.get("snapshot", {}).get("ms"),
              "judge_ms": stages.get("judge", {}).get("ms"), "ref_ms": t["reference"] * 1e3,
              "impl_ms": t["kernel"] * 1e3, "ref_tflops": fl / t["reference"] / 1e12})
        for name, st in stages.items():
            launches = "" if st["launches"] is None else f", {st['launches']:.0f} launches"
            emit({"kind": "stage", "shape": shape, "impl": f"{name}, block {count}", "ms": st["ms"],
                  "ops": st["ops"], "reads_back": st["reads_back"], "launches": st["launches"],
                  "ops_note": f"{st['ops']:.0f} ops, {st['reads_back']:.2g} reads back{launches} per case"})
    profile = get_profile(profile_name)
    for isolated in (False, True):
        for block in (1, BLOCK):
            emit(_throughput(subject, device, profile, examples, block, isolated))
    for isolated in (False, True):
        try:
            emit(parallel_throughput(device, profile_name, 4 * examples, BLOCK if device == "cuda" else 1, PARTS,
                                     isolated))
        except RuntimeError as exc:  # the rows before it are the bench's still
            print(f"parallel throughput failed: {exc}", flush=True)
    return out


_CPU_PROBE = """
import gc, sys, time, torch
from mla_verify import reference
from mla_verify.equivalence.cases.batch import make_batch
from mla_verify.equivalence.cases.params import ForwardParams
torch.set_num_threads(int(sys.argv[3]))
def rss(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field)) / 2**20
budget = int(sys.argv[2])
if sys.argv[1] == "context":
    p = dict(cache_dtype="fp8_ds_mla", heads=128, query_lens=[1, 1, 1, 1, 64], context_lens=[131071, 131071, 131071, 131071, 131008],
             block_size=64, topk=2048, sm_scale=0.1352, value_regime="normal", shuffle=True)
    b = make_batch(ForwardParams.of(p), 0)
    b.kv_source.clear()  # the harness's copy of the rows; the reference reads the cache
    run = lambda: reference.forward_mqa(b.q, b.kv_cache, b.topk_indices, b.metadata(reference.MQAMetadata)).path
else:  # a prefill streamed through the budget: 2.4 GB of K rows in float64 unchunked
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1024, 16, 576, generator=g).bfloat16()
    kv = torch.randn(65536, 576, generator=g).bfloat16()
    idx = torch.randint(0, 65536, (1024, 512), generator=g, dtype=torch.int32)
    def run():
        for _ in reference.sparse_prefill_chunks(q, kv, idx, 0.1352):
            pass
        return "streamed"
    for _ in reference.sparse_prefill_chunks(q[:2], kv, idx[:2], 0.1352):  # code pages and BLAS buffers resident
        pass
gc.collect()
inputs = rss("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # restart the peak-RSS counter
t = time.perf_counter()
with reference.memory_limit(budget):
    what = run()
print(time.perf_counter() - t, inputs, rss("VmHWM:") - inputs, what)
"""


def bench_reference_cpu(budget: int) -> list[dict]:
    """In fresh processes, so that their peak RSS is their own (every large allocation its own
    mapping, freed when freed): forward_mqa's reference over five 128k-token contexts, topk 2048,
    128 heads, under the budget; a prefill of 1024 tokens, 16 heads, topk 512 streamed under
    256 MiB (a CPU's few cores make a larger demonstration slow)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    threads = str(torch.get_num_threads())
    out = []
    for probe, shape, limit in (("context", "forward_mqa 5 x 128k context, topk 2048, H=128", budget),
                                ("stream", "prefill T=1024 H=16 topk 512", 256 << 20)):
        done = subprocess.run([sys.executable, "-c", _CPU_PROBE, probe, str(limit), threads], env=env,
                              capture_output=True, text=True, check=True)
        seconds, before, peak, what = done.stdout.split()
        out.append({"kind": "reference", "shape": shape, "impl": f"reference float64 cpu ({what})",
                    "ms": float(seconds) * 1e3, "peak_gib": float(peak), "budget_gib": limit / 2**30,
                    "inputs_gib": float(before)})
        print(json.dumps(out[-1]), flush=True)
    return out


NOTES = (("vs_standalone", "{:.3f}x standalone"), ("vs_flash_mla", "{:.0%} of flash_mla"), ("peak_gib", "peak {:.2f} GiB"),
         ("budget_gib", "(budget {:g} GiB)"), ("overhead_pct", "overhead {:.1f}%"), ("inputs_ms", "inputs {:.2f} ms"), ("snapshot_ms", "snapshot {:.2f} ms"),
         ("ref_ms", "reference {:.2f} ms"), ("ref_tflops", "({:.3g} TFLOP/s fp64)"), ("impl_ms", "kernel {:.2f} ms"),
         ("judge_ms", "judge {:.2f} ms"),
         ("cases_per_s", "{:.1f} cases/s"), ("ops_note", "{}"))


def table(rows: list[dict]) -> str:
    lines = [f"{'kind':9s} {'shape':44s} {'impl':32s} {'ms':>9s} {'TFLOP/s':>8s} {'GB/s':>7s}  notes"]
    for r in rows:
        notes = [fmt.format(r[key]) for key, fmt in NOTES if r.get(key) is not None]
        ms = f"{r['ms']:9.3f}" if "ms" in r else " " * 9
        tf = f"{r['tflops']:8.1f}" if "tflops" in r else " " * 8
        gb = f"{r['gbs']:7.0f}" if "gbs" in r else " " * 7
        lines.append(f"{r['kind']:9s} {r['shape']:44s} {r['impl']:32s} {ms} {tf} {gb}  {', '.join(notes)}")
    return "\n".join(lines)


SECTIONS = ("kernels", "reference", "harness", "guards", "history")


def main(args, device: str) -> int:
    from mla_verify.reference import memory_budget

    sections = args.only or SECTIONS
    budget = memory_budget()
    rows: list[dict] = []
    started = time.time()
    if device == "cuda":
        if "kernels" in sections:
            rows += bench_kernels(args.quick, reps=10 if args.quick else 30)
        if "reference" in sections:
            rows += bench_reference_gpu(args.quick, budget)
        if "harness" in sections:
            rows += bench_harness("cuda", "gpu", 40 if args.quick else 400)
    else:
        if "reference" in sections:
            rows += bench_reference_cpu(budget)
        if "harness" in sections:
            rows += bench_harness("cpu", "ci", 10 if args.quick else 40)
    if "guards" in sections:
        from .guard_bench import bench_guards

        rows += bench_guards(device, harness_case(device), args.quick)
    if "history" in sections:
        from .history_bench import bench_history

        rows += bench_history(args.quick)
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "seconds": time.time() - started, "quick": args.quick, "sections": list(sections),
            "reference_memory_bytes": budget}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(table(rows))
    print(f"bench written to {args.out}")
    return 0
