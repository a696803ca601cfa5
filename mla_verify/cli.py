"""`mla-verify`: the command-line tool. A thin layer over equivalence/, fuzz/ and reports/.

Exit codes (for CI): 0 = no discrepancy; 1 = a discrepancy (or a drift beyond the factor);
2 = usage error or bad input, with a one-line reason.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _prepare(device: str) -> None:
    """Triton decides interpreter vs compiler when kernels are defined: set it before importing them."""
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _run_id(kind: str) -> str:
    return f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when present, else cpu")


def _add_isolation(p: argparse.ArgumentParser) -> None:
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="run cases in a worker process replaced after a crash or hang (default: on for cuda)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a case may take in the worker")


def _add_deviation(p: argparse.ArgumentParser, default: list | None) -> None:
    p.add_argument("--deviation", action="append", default=default, metavar="NAME",
                   help="a documented deviation the --impl callable has (repeatable; `mla-verify list --deviations`); "
                        "its bounds replace the exact ones where it applies"
                        + ("" if default is not None else " (default: the ones saved with the case)"))


MIN_REFERENCE_MEMORY = 64 << 20
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}


def memory_size(text: str) -> int:
    """'4GiB', '512MiB', '1.5G' or a number of bytes -> bytes."""
    number = text.strip().rstrip("bBiIkKmMgG")
    unit = text.strip()[len(number):].lower()
    try:
        size = int(float(number) * _UNITS[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4GiB, 512MiB or a number of bytes") from None
    if size < MIN_REFERENCE_MEMORY:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 64MiB (one query token at 128 heads and top-k 2048 "
                                         "takes 17 MiB)")
    return size


def _add_reference_memory(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reference-memory", type=memory_size, default=None, metavar="SIZE",
                   help="working memory each reference call may hold, e.g. 2GiB (default 4GiB); "
                        "large cases run in more, smaller chunks")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mla-verify", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="ops, pipeline stages, their reference and the implementations available here")
    _add_common(p)
    p.add_argument("--tolerances", action="store_true", help="also print every bound of the tolerance policy")
    p.add_argument("--deviations", action="store_true",
                   help="also print each documented deviation a kernel may declare (--deviation): meaning and bounds")

    p = sub.add_parser("fuzz", help="fuzz one op (or forward_mqa) against the reference, or a property:NAME")
    _add_common(p)
    _add_isolation(p)
    _add_reference_memory(p)
    p.add_argument("--op", required=True, help="an op, forward_mqa, or property:NAME (`mla-verify list`)")
    p.add_argument("--path", default=None, help="forward_mqa: bf16 | fp8_mixed | fp8_separate | fp8_mixed_dcp; "
                   "property:NAME: one of its targets")
    p.add_argument("--world-size", type=int, default=None, choices=(2, 4, 8),
                   help="dcp only: rank processes (default 2); one GPU each when there are enough, else gloo")
    p.add_argument("--impl", action="append", default=[], metavar="[STAGE=]MODULE:CALLABLE|NAME",
                   help="implementation under test (default: the project's); repeat for several stages")
    _add_deviation(p, [])
    p.add_argument("--examples", type=int, default=None, help="default: the profile's budget")
    p.add_argument("--seed", type=int, default=None, help="campaign seed (printed; default: random)")
    p.add_argument("--profile", default=None, help="ci | dev | nightly | gpu (default: dev on cpu, gpu on cuda)")
    p.add_argument("--out", type=Path, default=Path("runs/fuzz"), help="run directory: rows, failing case files")
    p.add_argument("--no-shrink", action="store_true", help="report the first failing case as found")
    p.add_argument("--junit", type=Path, default=None)
    p.add_argument("--parallel", type=int, default=None,
                   help="independent campaigns (seeds S, S+1, ...) sharing the examples, one GPU each "
                        "(default: every GPU on cuda, 1 on cpu; dcp: 1, its ranks take the GPUs)")
    p.add_argument("--part", action="store_true", help=argparse.SUPPRESS)  # a child of --parallel

    p = sub.add_parser("replay", help="re-run a saved case exactly; exit 1 if it still fails")
    _add_common(p)
    _add_reference_memory(p)
    p.add_argument("file", type=Path)
    p.add_argument("--impl", action="append", default=None, metavar="[STAGE=]MODULE:CALLABLE|NAME",
                   help="replay against another implementation than the one saved")
    _add_deviation(p, None)

    p = sub.add_parser("gate", help="every op and path: regression corpus + fuzz budget; drift report; CI verdict")
    _add_common(p)
    _add_isolation(p)
    _add_reference_memory(p)
    p.add_argument("--profile", default=None, help="default: ci on cpu, gpu on cuda")
    p.add_argument("--examples", type=int, default=None,
                   help="fuzz examples per op (or property) and implementation; default: the profile's")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--op", action="append", default=None, help="restrict to these ops, property:NAME, or property (all of them)")
    p.add_argument("--out", type=Path, default=None, help="run directory (default: runs/gate-<time>)")
    p.add_argument("--baseline", type=Path, default=None, help="compare the drift with this earlier run")
    p.add_argument("--junit", type=Path, default=None)
    p.add_argument("--parallel", type=int, default=None,
                   help="split the ops over this many processes, one GPU each (default: every GPU on cuda, 1 on cpu)")
    p.add_argument("--part", action="store_true", help=argparse.SUPPRESS)  # a child of --parallel: rows only

    p = sub.add_parser("report", help="drift report of a run directory, optionally against a baseline run")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--baseline", type=Path, default=None)
    p.add_argument("--html", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--factor", type=float, default=2.0, help="flag drift when p99 error or bias grows beyond this")

    p = sub.add_parser("bench", help="kernel, reference and harness speed at production shapes; table + JSON")
    _add_common(p)
    _add_reference_memory(p)
    p.add_argument("--out", type=Path, default=Path("runs/bench.json"))
    p.add_argument("--quick", action="store_true", help="a few small shapes (a smoke run)")
    p.add_argument("--only", action="append", choices=("kernels", "reference", "harness"), default=None,
                   help="run only these sections (repeat; default: all)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = getattr(args, "device", None) or (_default_device() if args.command != "report" else "cpu")
    _prepare(device)
    if getattr(args, "reference_memory", None):
        from mla_verify.reference.attention import MEMORY_ENV

        os.environ[MEMORY_ENV] = str(args.reference_memory)  # read by the reference here and in every child process
    from mla_verify.equivalence.subject import UsageError

    try:
        return COMMANDS[args.command](args, device)
    except UsageError as exc:
        print(f"mla-verify: {exc}", file=sys.stderr)
        return 2


def cmd_list(args, device: str) -> int:
    from mla_verify.equivalence.ops import OPS
    from mla_verify.equivalence.policy import all_bounds
    from mla_verify.equivalence.properties import PROPERTIES
    from mla_verify.optimized import registry

    print(f"device: {device}")
    for name in sorted(OPS):
        spec = OPS[name]
        stage = spec.stage or "pipeline of stages"
        print(f"\n{name}  [{stage}]\n  {spec.doc}\n  reference: reference.{name}")
        if spec.stage is None:
            continue
        _print_implementations(registry, spec.stage, device)
    extra = sorted(set(registry.stages()) - {s.stage for s in OPS.values()})
    for stage in extra:
        print(f"\n{stage}  [pipeline stage]")
        _print_implementations(registry, stage, device)
    for prop in PROPERTIES.values():
        print(f"\n{prop.op}  [property: needs no reference]\n  {prop.doc}\n  checks: {', '.join(prop.checks)}; "
              f"targets (--path): {', '.join(prop.targets)}")
        print(f"  implementations here (--impl NAME): {', '.join(prop.implementations(device)) or 'none'}")
    if args.tolerances:
        print("\ntolerances (equivalence/policy.py):")
        for kind, where, b in all_bounds():
            print(f"  {kind:6s} {where or 'default':22s} {b.metric:16s} <= {b.limit:<10.4g} {b.reason}")
    if args.deviations:
        _print_deviations()
    return 0


def _print_deviations() -> None:
    import textwrap

    from mla_verify.equivalence.policy import DEVIATIONS

    def wrapped(text: str, indent: str = "    ") -> str:
        return textwrap.fill(text, 98, initial_indent=indent, subsequent_indent=indent)

    def bounds(by_kind) -> list[str]:
        return [f"      {kind:4s}" + ", ".join(f"{b.metric} <= {b.limit:.4g}" for b in bs) for kind, bs in by_kind.items()]

    print("\ndeviations (declare with --deviation NAME, deviations=, or __mla_verify_deviations__):")
    for dev in DEVIATIONS.values():
        print(f"\n  {dev.name}\n{wrapped(dev.description)}\n{wrapped('applies to: ' + dev.applies.__doc__)}")
        if dev.bounds:
            print("\n".join(["    bounds against the reference:", *bounds(dev.bounds)]))
        if dev.relaxes:
            print("\n".join([wrapped(f"relaxes the property checks {', '.join(sorted(dev.relaxes))} to:"),
                             *bounds(dev.property_bounds)]))


def _print_implementations(registry, stage: str, device: str) -> None:
    """One line per implementation of `stage`: can it run here, is it the stage's default here
    (what forward_mqa and a bare `--op` use), how it deviates from the contract."""
    try:
        default = registry.select(stage, device).name
    except RuntimeError:
        default = None
    for impl in registry.implementations(stage):
        why = impl.why_not(device)
        status = "available" if why is None else f"unavailable: {why}"
        if impl.name == default:
            status += ", default here"
        elif why is None and device in impl.interpreted_on:
            status += f", interpreted on {device}: by name only"
        dev = f"; deviations: {', '.join(impl.deviations)}" if impl.deviations else ""
        print(f"  - {impl.name:12s} {status}{dev}")


def _profile(name: str | None, device: str, default_cpu: str):
    from mla_verify.fuzz.profiles import get_profile

    try:
        return get_profile(name or (default_cpu if device == "cpu" else "gpu"))
    except KeyError as exc:
        from mla_verify.equivalence.subject import UsageError

        raise UsageError(str(exc.args[0])) from None


def _start_meta(profile: str, seed: int, device: str) -> dict:
    from mla_verify import reports

    return reports.collect_meta(profile, [seed], device, command=shlex.join(["mla-verify"] + sys.argv[1:]))


def _write_run(run_dir: Path, rows, meta: dict) -> None:
    from mla_verify import reports

    reports.write_run(run_dir, rows, reports.finish_meta(meta))


def cmd_fuzz(args, device: str) -> int:
    from mla_verify.equivalence import distributed
    from mla_verify.equivalence.evaluate import evaluate
    from mla_verify.equivalence.isolation import Worker
    from mla_verify.equivalence.ops import OPS
    from mla_verify.equivalence.properties import get_property, is_property
    from mla_verify.equivalence.subject import UsageError, resolve_subject
    from mla_verify.fuzz.campaign import fuzz, new_seed
    from mla_verify.fuzz.strategies import FORWARD_PATHS

    if args.world_size is not None and args.op != "dcp":
        raise UsageError("--world-size applies to --op dcp only")
    world_size = (args.world_size or 2) if args.op == "dcp" else None
    if is_property(args.op):
        subject = resolve_subject(args.op, args.impl, device, deviations=args.deviation)
        prop = get_property(args.op)
        covered = prop.covered(subject.overrides)  # the targets this --impl takes part in
        if args.path is None and len(covered) == 1:
            args.path = covered[0]
        elif (args.path is None and len(covered) < len(prop.targets)) or args.path not in (None, *covered):
            raise UsageError(f"--path: {args.op} with this --impl runs on one of {', '.join(covered)}")
    else:
        if args.op not in OPS:
            raise UsageError(f"unknown op {args.op!r}; known: {', '.join(sorted(OPS))}, or property:NAME")
        if args.path is not None and (args.op != "forward_mqa" or args.path not in FORWARD_PATHS):
            raise UsageError(f"--path applies to --op forward_mqa with one of {', '.join(FORWARD_PATHS)}")
        subject = resolve_subject(args.op, args.impl, device, deviations=args.deviation)
    profile = _profile(args.profile, device, "dev")
    examples = args.examples or (profile.property_examples if is_property(args.op) else profile.examples)
    seed = new_seed() if args.seed is None else args.seed
    run_id = _run_id("fuzz")
    # An op whose implementation runs in processes of its own is isolated already.
    isolate = ((device == "cuda" if args.isolate is None else args.isolate)
               and (is_property(args.op) or not OPS[args.op].own_processes))
    distributed.set_timeout(args.timeout)
    ranks = f", {world_size} ranks ({distributed.placement(world_size, device).describe()})" if world_size else ""
    print(f"mla-verify fuzz: op {args.op}, implementation {subject.label}, {examples} examples, profile {profile.name}, "
          f"device {device}, seed {seed}{ranks}{', isolated' if isolate else ''}", flush=True)
    meta = _start_meta(profile.name, seed, device)
    parts = 1 if args.part or world_size else (args.parallel or (_gpu_count() if device == "cuda" else 1))
    if parts > 1:
        return _fuzz_in_parts(args, device, profile.name, examples, seed, meta, parts)
    notes: set[str] = set()
    worker = Worker(device, args.timeout) if isolate else None

    def run(case, source):
        if worker is not None:
            return worker.run(case, args.impl, subject.label, run_id, source, notes=notes, deviations=subject.declared)
        return evaluate(case, subject, device, run_id=run_id, source=source, notes=notes)

    try:
        result = fuzz(args.op, run, profile=profile, examples=examples, seed=seed, impl_specs=tuple(args.impl),
                      deviations=subject.declared, device=device, out_dir=args.out, shrink=not args.no_shrink,
                      path=args.path, world_size=world_size)
    finally:
        if worker is not None:
            worker.close()
    for note in sorted(notes):
        print(f"note: {note}")
    if world_size:
        print(f"worst per rank over {result.examples} cases (metric value/bound):")
        for line in distributed.worst_by_rank(result.rows):
            print(f"  {line}")
    _write_run(args.out, result.rows, meta)
    if args.junit:
        from .junit import write_junit

        write_junit(args.junit, result.rows)
    if result.failure is None:
        gated = [r for r in result.rows if r.gate_metric and r.passed]
        tightest = min(gated, key=lambda r: r.headroom, default=None)
        room = f"; least headroom: {tightest.tensor} {tightest.gate_metric} = {tightest.value:.3g} of {tightest.bound:.3g}" if tightest else ""
        print(f"PASS: {result.examples} examples, no discrepancy (seed {seed}){room}")
        return 0
    d = result.failure
    print(f"DISCREPANCY in {args.op} ({subject.label}) at example {result.first_failure_at}, seed {seed}")
    print(f"  minimized case: {d.case.short()}")
    for r in d.rows:
        if not r.passed:
            print(f"  {r.tensor}: {r.gate_metric} = {r.value:.4g}, bound {r.bound:.4g} -- {r.reason}")
    if result.case_file:
        print(f"  case saved: {result.case_file}")
        print(f"  replay: mla-verify replay {result.case_file} --device {device}")
    return 1


def _fuzz_in_parts(args, device: str, profile: str, examples: int, seed: int, meta: dict, parts: int) -> int:
    from mla_verify.equivalence.rows import Row

    from .parallel import fuzz_parts, share

    child = ["--op", args.op, "--profile", profile, "--timeout", str(args.timeout),
             *(a for spec in args.impl for a in ("--impl", spec)),
             *(a for name in args.deviation for a in ("--deviation", name))]
    child += ["--path", args.path] if args.path else []
    child += ["--no-shrink"] if args.no_shrink else []
    child += [] if args.isolate is None else ["--isolate" if args.isolate else "--no-isolate"]
    shares = share(examples, parts)
    print(f"  {len(shares)} campaigns, one per {'GPU' if device == 'cuda' else 'process'}: "
          + ", ".join(f"seed {seed + i} x {n}" for i, n in enumerate(shares)) + f"; logs {args.out}/part-*/fuzz.log",
          flush=True)
    frame, results = fuzz_parts(child, examples, seed, parts, device, args.out)
    _write_run(args.out, frame, meta)
    rows = [Row(**r) for r in frame.to_dict("records")]
    if args.junit:
        from .junit import write_junit

        write_junit(args.junit, rows)
    worst = 0
    for part, (part_seed, code, log) in enumerate(results):
        lines = log.read_text().splitlines() if log.exists() else []
        start = next((i for i, line in enumerate(lines) if line.startswith("DISCREPANCY")), None)
        shown = lines[start:] if start is not None else lines[-1:] if code == 0 else lines[-5:]
        print(f"part {part} (seed {part_seed}): exit {code}")
        for line in shown:
            print(f"  {line}")
        worst = max(worst, code if code in (0, 1, 2) else 1)  # killed by a signal: a failure
    if worst == 0:
        print(f"PASS: {examples} examples over {len(results)} campaigns, no discrepancy (seeds {seed}..{seed + len(results) - 1})")
    return worst


def cmd_replay(args, device: str) -> int:
    from mla_verify.equivalence.evaluate import evaluate
    from mla_verify.equivalence.subject import UsageError, resolve_subject
    from mla_verify.fuzz import casefile

    try:
        cf = casefile.load(args.file)
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(f"cannot read case file {args.file}: {exc}") from None
    specs = tuple(args.impl) if args.impl is not None else cf.impl
    # The saved deviations belong to the saved implementation.
    deviations = args.deviation if args.deviation is not None else cf.deviations if args.impl is None else ()
    subject = resolve_subject(cf.case.op, specs, device, deviations=deviations)
    print(f"replay {cf.case.short()} on {device} with {subject.label}")
    if cf.failure:
        print("  saved failure: " + "; ".join(f"{f['tensor']} {f['metric']} = {f['value']:.4g} (bound {f['bound']:.4g})" for f in cf.failure))
    rows = evaluate(cf.case, subject, device, source="replay")
    for r in rows:
        verdict = "ok  " if r.passed else "FAIL"
        detail = r.reason if not r.passed else f"{r.gate_metric} = {r.value:.4g} of {r.bound:.4g}"
        print(f"  {verdict} {r.tensor:17s} {detail}")
    return 0 if all(r.passed for r in rows) else 1


def cmd_gate(args, device: str) -> int:
    from mla_verify.fuzz.campaign import new_seed
    from mla_verify.fuzz.gate import odd_ones_out, run_gate

    profile = _profile(args.profile, device, "ci")
    seed = new_seed() if args.seed is None else args.seed
    run_id = _run_id("gate")
    out = args.out or Path("runs") / run_id
    isolate = device == "cuda" if args.isolate is None else args.isolate
    budget = (f"{args.examples}" if args.examples is not None
              else f"{profile.examples} (properties: {profile.property_examples})")
    print(f"mla-verify gate: device {device}, profile {profile.name}, {budget} fuzz examples per op and "
          f"implementation, seed {seed}, run {out}", flush=True)
    started = time.time()
    meta = _start_meta(profile.name, seed, device)
    parts = args.parallel or (_gpu_count() if device == "cuda" else 1)
    if parts > 1 and not args.part:
        return _gate_in_parts(args, device, profile, seed, out, meta, parts, started)
    result = run_gate(device=device, profile=profile, examples=args.examples, seed=seed, run_id=run_id, out_dir=out,
                      isolate=isolate, timeout_s=args.timeout, ops=args.op)
    for note in sorted(result.notes):
        print(f"note: {note}")
    for line in odd_ones_out(result.rows):
        print(f"odd one out: {line}")
    _write_run(out, result.rows, meta)
    for fz in result.fuzz:
        if fz.case_file:
            print(f"failing case saved: {fz.case_file}  (mla-verify replay {fz.case_file} --device {device})")
    if args.part:
        return 1 if result.failed else 0
    return _finish_gate(args, out, result.rows, result.failed, started)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _finish_gate(args, out: Path, rows, failed: bool, started: float) -> int:
    from mla_verify import reports

    if args.junit:
        from .junit import write_junit

        write_junit(args.junit, rows)
    code = reports.run_report(out, baseline=args.baseline)
    print(f"gate {'FAILED' if failed else 'passed'}: {len(rows)} rows in {time.time() - started:.0f} s; "
          f"report {out / 'report.html'}")
    return 1 if failed else code


def _gate_in_parts(args, device, profile, seed, out, meta, parts, started) -> int:
    from mla_verify.equivalence.ops import OPS
    from mla_verify.equivalence.properties import PROPERTIES
    from mla_verify.equivalence.rows import Row

    from .parallel import run_parts

    ops = args.op or [*sorted(OPS), *(p.op for p in PROPERTIES.values())]
    ops = [o for op in ops for o in ([p.op for p in PROPERTIES.values()] if op == "property" else [op])]
    child = ["--profile", profile.name, "--seed", str(seed), "--timeout", str(args.timeout)]
    if args.examples is not None:
        child += ["--examples", str(args.examples)]
    if args.isolate is not None:
        child += ["--isolate" if args.isolate else "--no-isolate"]
    print(f"  {parts} parts, one per {'GPU' if device == 'cuda' else 'process'}", flush=True)
    frame, worst = run_parts(ops, parts, device, out, child)
    _write_run(out, frame, meta)
    rows = [Row(**r) for r in frame.to_dict("records")]
    failed = worst != 0 or any(not r.passed for r in rows)
    return _finish_gate(args, out, rows, failed, started)


def cmd_report(args, device: str) -> int:
    from mla_verify import reports

    return reports.run_report(args.run_dir, baseline=args.baseline, html=args.html, markdown=args.markdown,
                              factor=args.factor)


def cmd_bench(args, device: str) -> int:
    from . import bench

    return bench.main(args, device)


COMMANDS = {"list": cmd_list, "fuzz": cmd_fuzz, "replay": cmd_replay, "gate": cmd_gate, "report": cmd_report,
            "bench": cmd_bench}

if __name__ == "__main__":
    sys.exit(main())
