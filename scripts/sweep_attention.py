"""One H200 run that decides the Triton attention defaults: FlashMLA against every launch variant.

    PYTHONPATH=/tmp/site:$PWD python3 scripts/sweep_attention.py [--op prefill|decode|both] [--out FILE]

For prefill (T=4096, H 128 and 64, 65536 KV rows) and decode (B=64 s_q=1 H=128, B=128 s_q=2
H=128, B=64 s_q=2 H=64; 8192 pages of 64), topk 2048: FlashMLA standalone and each entry of
`attention_launch.PREFILL_VARIANTS` / `DECODE_VARIANTS`, timed call by call in turn over rotated
inputs (CUDA events, medians; mla_verify.bench.bench's timer and inputs). Each variant's first call is
timed on its own: that is its compilation. Each variant's output on the first input set is
compared with FlashMLA's: out error as max |triton - flash_mla| over the row's max |flash_mla|,
in bf16 roundings (2^-8), and the max lse difference. Identical arithmetic up to summation order gives ~1-4 units; a wrong
variant gives hundreds or NaN. Two diagnostics: prefill H=128 again over 4096 KV rows (they fit
in L2; the gap to the 65536-row line is what HBM latency costs each kernel), and at B=128 s_q=2
the prefill kernel over a dequantized copy of the cache (the decode kernel minus its dequant).

The table (TFLOP/s, % of FlashMLA, compile seconds, errors) prints last; --out writes it as JSON.
A deadline (--budget seconds) skips the remaining shapes so the table always prints.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mla_verify import adapters
from mla_verify.bench.bench import SM_SCALE, TOPK, _decode_inputs, _median_ms, _prefill_inputs, flops
from mla_verify.optimized import flashmla
from mla_verify.optimized.kernels.attention_launch import DECODE_VARIANTS, PREFILL_VARIANTS
from mla_verify.optimized.kernels.sparse_decode import launch_sparse_decode_fp8
from mla_verify.optimized.kernels.sparse_prefill import launch_sparse_prefill

FLASH = "flash_mla"
BF16_ROUNDING = 2.0**-8
PREFILL_SHAPES = ((4096, 128), (4096, 64))                # (tokens, heads) over 65536 KV rows
DECODE_SHAPES = ((64, 1, 128), (128, 2, 128), (64, 2, 64))  # (batch, s_q, heads)
BF16_ROWS_SHAPE = (128, 2, 128)                          # where the dequant-free diagnostic runs


@dataclass
class Row:
    shape: str
    impl: str
    us: float
    tflops: float
    pct_flash: float | None
    compile_s: float
    out_units: float | None  # max |out - flash| / max_row |flash|, in units of 2^-8
    lse_diff: float | None


def compare(got, ref) -> tuple[float, float]:
    """(out error in bf16 roundings of the row's largest |ref|, max |lse - ref lse| where finite)."""
    out, lse = got[0].float(), got[1].float()
    ref_out, ref_lse = ref[0].float(), ref[1].float()
    if out.isnan().any() or lse.isnan().any():
        return float("nan"), float("nan")
    scale = ref_out.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
    units = float(((out - ref_out).abs() / scale).max()) / BF16_ROUNDING
    live = torch.isfinite(ref_lse)
    if not torch.equal(torch.isfinite(lse), live):
        return units, float("inf")
    return units, float((lse - ref_lse).abs()[live].max()) if live.any() else 0.0


def time_shape(shape: str, fl: float, fns: dict, flash_output, reps: int) -> list[Row]:
    """fns: name -> (fn, input sets); flash_output() -> FlashMLA's (out, lse) on the first set,
    or None where FlashMLA is unavailable."""
    compile_s, errors = {}, {}
    ref = flash_output() if flash_output else None
    for name, (fn, sets) in fns.items():
        start = time.perf_counter()
        got = fn(*sets[0])
        torch.cuda.synchronize()
        compile_s[name] = time.perf_counter() - start
        if ref is not None and name != FLASH:
            errors[name] = compare(got, ref)
        del got
    ms = _median_ms(fns, reps)
    rows = []
    for name, t in ms.items():
        tf = fl / t / 1e9
        pct = 100 * ms[FLASH] / t if FLASH in ms else None
        units, lse = errors.get(name, (None, None))
        row = Row(shape, name, t * 1e3, tf, pct, compile_s[name], units, lse)
        print(json.dumps(asdict(row)), flush=True)
        rows.append(row)
    return rows


def prefill_rows(tokens: int, heads: int, kv_rows: int, names: list[str] | None, reps: int, gen) -> list[Row]:
    """FlashMLA and the prefill variants (all, or `names`) over `kv_rows` random rows."""
    sets, _ = _prefill_inputs(tokens, heads, kv_rows, gen)
    variants = {n: c for n, c in PREFILL_VARIANTS.items() if names is None or n in names}
    fns = {f"triton[{n}]": (lambda q, kv, i, cfg=cfg: launch_sparse_prefill(q, kv, i, SM_SCALE, None, None, cfg), sets)
           for n, cfg in variants.items()}
    flash_output = None
    if flashmla.flash_mla_unavailable() is None:
        import flash_mla

        raw = [(adapters.pad_heads(q, 0.0), kv.unsqueeze(1), idx.unsqueeze(1)) for q, kv, idx in sets]
        fns[FLASH] = (lambda q, kv, i: flash_mla.flash_mla_sparse_fwd(q, kv, i, SM_SCALE, use_legacy=True), raw)
        flash_output = lambda: flashmla.launch_sparse_prefill(*sets[0], SM_SCALE)  # noqa: E731
    shape = f"prefill T={tokens} H={heads}" + ("" if kv_rows == 65536 else f" N={kv_rows} (L2)")
    return time_shape(shape, flops(tokens, heads), fns, flash_output, reps)


def decode_rows(batch: int, s_q: int, heads: int, reps: int, gen, bf16_rows: bool = False) -> list[Row]:
    """FlashMLA and the decode variants over a cache of 8192 pages; bf16_rows adds the diagnostic `prefill on bf16 rows`: the prefill kernel over a dequantized
    copy of the cache, i.e. the decode kernel's work without its dequantization."""
    sets, _ = _decode_inputs(batch, s_q, heads, 8192, gen)
    fns = {f"triton[{n}]": (lambda q, c, i, cfg=cfg: launch_sparse_decode_fp8(q, c, i, SM_SCALE, cfg), sets)
           for n, cfg in DECODE_VARIANTS.items()}
    if bf16_rows:
        from mla_verify import reference

        rows = reference.dequantize_fp8_ds_mla(sets[0][1].view(-1, 656))
        flat = [(q.view(batch * s_q, heads, 576), rows, i.view(batch * s_q, TOPK)) for q, _, i in sets]
        fns["prefill on bf16 rows"] = (lambda q, kv, i: prefill_as_decode(q, kv, i, batch, s_q), flat)
    flash_output = None
    if flashmla.flash_mla_unavailable() is None:
        import flash_mla

        plan = flash_mla.get_mla_metadata()[0]
        raw = [(adapters.pad_heads(q, 0.0), c.unsqueeze(-2), i) for q, c, i in sets]
        fns[FLASH] = (lambda q, c, i: flash_mla.flash_mla_with_kvcache(
            q, c, None, None, 512, plan, softmax_scale=SM_SCALE, is_fp8_kvcache=True, indices=i, use_legacy=True), raw)
        flash_output = lambda: flashmla.launch_sparse_decode_fp8(*sets[0], SM_SCALE)  # noqa: E731
    return time_shape(f"decode B={batch} s_q={s_q} H={heads}", flops(batch * s_q, heads), fns, flash_output, reps)


def prefill_as_decode(q, kv, idx, batch: int, s_q: int):
    """The default prefill kernel on decode rows, returned in decode's layout for `compare`."""
    out, lse, _ = launch_sparse_prefill(q, kv, idx, SM_SCALE, None, None)
    heads = q.shape[1]
    return out.view(batch, s_q, heads, -1), lse.view(batch, s_q, heads).transpose(1, 2)


def table(rows: list[Row]) -> str:
    lines = [f"{'shape':32s} {'impl':26s} {'us':>9s} {'TFLOP/s':>8s} {'%FM':>5s} {'compile':>7s} {'out':>6s} {'lse':>8s}"]
    for r in rows:
        pct = f"{r.pct_flash:5.0f}" if r.pct_flash is not None else " " * 5
        units = f"{r.out_units:6.1f}" if r.out_units is not None else " " * 6
        lse = f"{r.lse_diff:8.1e}" if r.lse_diff is not None else " " * 8
        lines.append(f"{r.shape:32s} {r.impl:26s} {r.us:9.1f} {r.tflops:8.1f} {pct} {r.compile_s:6.1f}s {units} {lse}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--op", choices=["prefill", "decode", "both"], default="both")
    parser.add_argument("--reps", type=int, default=15, help="timed calls per implementation and shape")
    parser.add_argument("--budget", type=float, default=140.0, help="seconds after which remaining shapes are skipped")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    import triton

    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}; "
          f"flash_mla: {flashmla.flash_mla_unavailable() or 'available'}", flush=True)
    started = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    steps = []
    if args.op in ("prefill", "both"):
        steps += [lambda t=t, h=h: prefill_rows(t, h, 65536, None, args.reps, gen) for t, h in PREFILL_SHAPES]
    if args.op in ("decode", "both"):
        steps += [lambda b=b, s=s, h=h: decode_rows(b, s, h, 2 * args.reps, gen, (b, s, h) == BF16_ROWS_SHAPE)
                  for b, s, h in DECODE_SHAPES]
    if args.op in ("prefill", "both"):
        tokens, heads = PREFILL_SHAPES[0]
        steps.append(lambda: prefill_rows(tokens, heads, 4096, ["default", "pf2"], args.reps, gen))
    rows: list[Row] = []
    for i, step in enumerate(steps):
        if time.perf_counter() - started > args.budget:
            print(f"budget of {args.budget:.0f} s spent: {len(steps) - i} shape(s) skipped", flush=True)
            break
        rows += step()
        torch.cuda.empty_cache()
    print(f"sweep took {time.perf_counter() - started:.0f} s; topk {TOPK}, FLOPs = 2 tokens H topk (576 + 512)")
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
