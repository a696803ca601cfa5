"""Where an in-process fuzz campaign's time goes, for issue 28's throughput work: the campaign that
`mla-verify bench --only harness` times (sparse_decode_fp8, profile gpu, blocks of 8), run under
cProfile (Python functions by own and cumulative time) and under torch.profiler (device busy time
against wall time, the costliest kernels, the host's waits on the device), with the mix of case
sizes drawn. Writes the tables under --out; prints a summary last.

    python3 scripts/profile_fuzz.py --device cuda --examples 400 --out $OUT

With --harness, the same tables for the bench's harness case instead (decode B=64 s_q=2 H=128 on
a GPU), `--examples` cases of it evaluated in blocks of `--block`: where its overhead goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch


def campaign(device: str, examples: int, block: int, sizes: list | None = None) -> tuple[int, float]:
    """The bench's in-process campaign: (cases, seconds)."""
    from mla_verify.equivalence.catalog import evaluate_block, resolve_subject
    from mla_verify.equivalence.cases.profiles import get_profile
    from mla_verify.fuzz.campaign import Campaign, fuzz

    subject = resolve_subject("sparse_decode_fp8", [], device)

    def run_block(cases, source, on_call=None):
        if sizes is not None:
            p = cases[0].params
            sizes.extend([p["batch"] * p["s_q"] * p["heads"] * p["topk"]] * len(cases))
        return evaluate_block(cases, subject, device, source=source, on_call=on_call)

    start = time.perf_counter()
    profile = get_profile("gpu" if device == "cuda" else "ci")
    result = fuzz(Campaign("sparse_decode_fp8", profile, examples, 3, block=block, shrink=False, covering=False),
                  run_block)  # the draws alone: covering cases run one at a time, whatever the block
    return result.examples, time.perf_counter() - start


def harness(device: str, examples: int, block: int, sizes: list | None = None) -> tuple[int, float]:
    """The bench's harness case, `examples` cases in blocks of `block` (successive seeds): (cases, seconds)."""
    from mla_verify.bench.bench import harness_case
    from mla_verify.equivalence.cases.case import Case
    from mla_verify.equivalence.catalog import evaluate_block, resolve_subject

    case, subject = harness_case(device), resolve_subject("sparse_decode_fp8", [], device)
    p = case.params
    start = time.perf_counter()
    for first in range(0, examples, block):
        cases = [Case(case.op, p, case.seed + first + i) for i in range(min(block, examples - first))]
        if sizes is not None:
            sizes.extend([p["batch"] * p["s_q"] * p["heads"] * p["topk"]] * len(cases))
        evaluate_block(cases, subject, device)
    return examples, time.perf_counter() - start


def _timers() -> dict[str, list[float]]:
    """Wrap the functions a case goes through with host-clock accumulators (no device syncs of
    their own: a function that waits on the device counts its wait): name -> [seconds, calls]."""
    from mla_verify.equivalence.sandbox import call_guards, calls, guards
    from mla_verify.equivalence.catalog import get_spec
    from mla_verify.equivalence.ops import attention, base
    from mla_verify.reference import attention as ref_attention

    spent: dict[str, list[float]] = {}

    def wrap(owner, attr: str, label: str, setter=setattr) -> None:
        fn = getattr(owner, attr)
        spent[label] = [0.0, 0]

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label][0] += time.perf_counter() - start
                spent[label][1] += 1

        setter(owner, attr, timed)

    spec = get_spec("sparse_decode_fp8")
    frozen = object.__setattr__
    wrap(spec, "inputs", "inputs", frozen)
    wrap(attention, "fill_selected_slots", "  fill_selected_slots")
    wrap(spec, "_answer", "reference (block)", frozen)
    wrap(ref_attention, "_decode_rows", "  reference index check")
    wrap(attention, "_elem_bounds", "  derived bounds")
    wrap(base, "call_implementation", "call_implementation")
    wrap(spec, "call", "  the implementation (timed)", frozen)
    wrap(guards.Watch, "__init__", "Watch taken (a block)")
    wrap(guards.Watch, "restore", "  Watch.restore")
    wrap(calls, "timed", "  timed (syncs)")
    wrap(call_guards.Snapshot, "__init__", "Snapshot taken")
    wrap(base, "changed_together", "Snapshots compared (a block)")
    wrap(guards, "owned", "owned copies")
    wrap(spec, "_verdicts", "verdicts (block)", frozen)
    wrap(base, "judge_many", "  judge_many")
    wrap(torch.cuda, "synchronize", "torch.cuda.synchronize")
    # Namespaces re-taken after a call changed them (each costs the per-name slow path).
    taken = guards._Namespace.of.__func__

    def of(cls, name, ns, is_class):
        RETAKEN[name] = RETAKEN.get(name, 0) + 1
        return taken(cls, name, ns, is_class)

    guards._Namespace.of = classmethod(of)
    return spent


RETAKEN: dict[str, int] = {}


def dispatch_us(device: str) -> str:
    """The host's cost of one small aten op and of one Python call here: the unit the campaign's
    per-case op counts multiply."""
    x = torch.ones(64, device=device)
    for _ in range(200):
        x.add_(1)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(2000):
        x.add_(1)
    if device == "cuda":
        torch.cuda.synchronize()
    op = (time.perf_counter() - start) / 2000 * 1e6
    start = time.perf_counter()
    for _ in range(20000):
        statistics.fmean((1.0,))
    call = (time.perf_counter() - start) / 20000 * 1e6
    return f"host: one small aten op {op:.1f} us, one small Python call {call:.2f} us"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--examples", type=int, default=400)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("runs/profile"))
    ap.add_argument("--harness", action="store_true", help="profile the bench's harness case, not the fuzz campaign")
    args = ap.parse_args()
    run = harness if args.harness else campaign
    args.out.mkdir(parents=True, exist_ok=True)
    summary = []

    run(args.device, 16, args.block)  # compilation, plans, allocator pools
    summary.append(dispatch_us(args.device))
    sizes: list[int] = []
    n, s = run(args.device, args.examples, args.block, sizes)
    summary.append(f"plain: {n} cases in {s:.2f} s = {n / s:.1f} cases/s")
    flops = [2.0 * x * 1088 for x in sizes]
    summary.append(f"case FLOPs: mean {statistics.mean(flops) / 1e9:.2f} G, median {statistics.median(flops) / 1e9:.2f} G, "
                   f"max {max(flops) / 1e9:.2f} G; total {sum(flops) / 1e12:.3f} TFLOP -> {sum(flops) / s / 1e12:.2f} "
                   "TFLOP/s of reference work over the campaign's wall time")

    prof = cProfile.Profile()
    prof.enable()
    n, s = run(args.device, args.examples, args.block)
    prof.disable()
    summary.append(f"cProfile: {n} cases in {s:.2f} s = {n / s:.1f} cases/s")
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(60)
        (args.out / f"cprofile_{key}.txt").write_text(buf.getvalue())

    if args.device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            n, s = run(args.device, args.examples // 2, args.block)
            torch.cuda.synchronize()
        events = tp.key_averages()
        device_us = sum(e.self_device_time_total for e in events)
        waits = [e for e in events if "Synchronize" in e.key or "synchronize" in e.key]
        wait_us = sum(e.cpu_time_total for e in waits)
        summary.append(f"torch.profiler: {n} cases in {s:.2f} s (profiled); device busy {device_us / 1e6:.2f} s "
                       f"({100 * device_us / 1e6 / s:.0f}% of wall); host waits on syncs {wait_us / 1e6:.2f} s in "
                       f"{sum(e.count for e in waits)} calls")
        (args.out / "cuda_kernels.txt").write_text(events.table(sort_by="self_device_time_total", row_limit=40))
        (args.out / "cpu_ops.txt").write_text(events.table(sort_by="self_cpu_time_total", row_limit=60))
    spent = _timers()
    n, s = run(args.device, args.examples, args.block)
    lines = [f"timers: {n} cases in {s:.2f} s = {n / s:.1f} cases/s; per case (host clock, nested entries indented):"]
    if args.device == "cuda":
        lines.insert(0, f"GPU memory: peak allocated {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB, "
                        f"peak reserved {torch.cuda.max_memory_reserved() / 2**30:.1f} GiB")
    lines += [f"  {name:34s} {t / n * 1e3:7.3f} ms  {calls / n:6.2f} calls" for name, (t, calls) in spent.items()]
    blocks = min(RETAKEN.values(), default=0)  # every namespace is taken once a block
    lines.append("namespaces taken more often than once a block: " + (", ".join(
        f"{name} x{count}" for name, count in RETAKEN.items() if count > blocks) or "none"))
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print(buf.getvalue()[-5000:])
    summary += lines
    print("\n".join(summary))
    (args.out / "summary.txt").write_text("\n".join(summary) + "\n")


if __name__ == "__main__":
    main()
