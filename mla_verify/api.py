"""The Python API: what `mla-verify fuzz`, `gate` and `replay` do, as calls a kernel
repository's own pytest suite can make (the CLI parses arguments into these and prints).

    check(op, impl, ...) -> CheckResult          fuzz an op, pipeline or property against the reference
    assert_equivalent(op, impl, ...)             check(); AssertionError with the CLI's report on failure
    replay(case_file, impl, ...) -> CheckResult  re-run a saved case, and say whether it reproduced
    property_check(name, impl, ...)              check() of a property (needs no reference)
    drift(run, baseline, ...) -> Drift           did the run move away from the exact answer since the baseline?
    gate(...) -> GateOutcome                     every op and implementation here: the CI gate
    run(options) -> CheckResult | GateOutcome    either, from one `runs.plan.Options` (what the CLI parses)
    history(runs, html=...) -> History           many runs of one kernel line: trend and marked steps

check() and gate() validate their arguments into one `Run` (mla_verify.runs.plan), which `runs.driver.execute`
runs in this process (`runs.start` builds its parts, `runs.driver.drive` composes them), or in parts on
this host's GPUs; a shard (shard="I/N") runs its share of it.

`check(..., baseline=RUN)` re-draws the baseline run's cases (its seed, profile and budget), so that
`drift` pairs them case for case: the way to ask "is my kernel v2 worse than v1?".

`impl` is a callable, "MODULE:CALLABLE", a registered implementation name (`mla-verify list`),
for a pipeline op or a property a dict {stage: impl}, or None for the project's own. A callable
that can be imported by its module and name runs like "MODULE:CALLABLE": in an isolation worker,
judged in this process (the default, on CPU as on CUDA); any other callable (a lambda, a closure, a
partial) runs in this process, and its result says so (`CheckResult.in_process`).
"""

from __future__ import annotations

import importlib
import json
import types
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.catalog import get_spec, resolve_subject
from mla_verify.equivalence.errors import HarnessError
from mla_verify.equivalence.sandbox.boundary import MODES
from mla_verify.equivalence.blocks import Judging, default_isolation
from mla_verify.equivalence.judge.policy import DRIFT_CONFIDENCE, DRIFT_FACTOR, DRIFT_MIN_CASES
from mla_verify.equivalence.judge.rows import Row, RowContext
from mla_verify.equivalence.properties.base import property_op
from mla_verify.equivalence.sandbox.calls import Unsupported, unsupported
from mla_verify.equivalence.sandbox.device import device_type
from mla_verify.equivalence.subject import LOCAL, local_label
from mla_verify.equivalence.errors import UsageError
from mla_verify.fuzz import casefile
from mla_verify.reports.drift import compare
from mla_verify.reports.history import history as read_history
from mla_verify.reports.history_html import write_history
from mla_verify.reports.pairing import parse_pairs
from mla_verify.reports.store import rows_frame

from .junit import saved_replays, write_junit
from .pytest_plugin import DEFAULTS, default_device, saved
from .runs.driver import execute
from .runs.outcome import DEFAULT_TIMEOUT_S, CheckResult, Failure, GateOutcome, replay_command
from .runs.plan import FUZZ, GATE, Options, plan, positive, resolve_device, timeout_needs_isolation, writable_file
from .runs.rundir import load_run

Impl = Union[None, str, Callable, Mapping[str, Union[str, Callable]], Sequence[str]]
# Callables that cannot be imported by name (lambdas, closures, partials) are reached through
# here in this process: "mla_verify.api:local.NAME" resolves like any MODULE:CALLABLE.
local = types.SimpleNamespace()

__all__ = ["CheckResult", "Failure", "GateOutcome", "HarnessError", "Unsupported", "UsageError", "assert_equivalent",
           "check", "drift", "gate", "history", "property_check", "replay", "unsupported"]

# ----------------------------------------------------------------------------- inputs


def _callable_spec(fn: Callable) -> tuple[str, bool]:
    """("MODULE:QUALNAME", True) for a callable importable by name, else a name in `local` (False)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if module and qualname and module != "__main__" and "<" not in qualname:
        try:
            obj = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            obj = None
        if obj is fn:
            return f"{module}:{qualname}", True
    name = f"fn{len(vars(local))}_{getattr(fn, '__name__', 'callable').strip('<>')}"
    setattr(local, name, fn)
    return f"{LOCAL}{name}", False


def impl_specs(impl: Impl) -> tuple[tuple[str, ...], bool]:
    """`impl` as --impl strings, and whether every one can be imported in another process."""
    if impl is None:
        return (), True
    if isinstance(impl, str):
        return (impl,), True
    if callable(impl):
        spec, named = _callable_spec(impl)
        return (spec,), named
    if isinstance(impl, Mapping):
        specs, named = [], True
        for stage, x in impl.items():
            if isinstance(x, str):
                specs.append(f"{stage}={x}")
            elif callable(x):
                spec, ok = _callable_spec(x)
                specs.append(f"{stage}={spec}")
                named &= ok
            else:
                raise UsageError(f"impl[{stage!r}]: expected a callable or a name, got {type(x).__name__}")
        return tuple(specs), named
    if isinstance(impl, (list, tuple)) and all(isinstance(s, str) for s in impl):
        return tuple(impl), True
    raise UsageError(f"impl: expected a callable, 'MODULE:CALLABLE', a registered name or {{stage: impl}}, "
                     f"got {type(impl).__name__}")


def _label(subject) -> str:
    """The rows' name for the implementation; a local callable by its own name."""
    return local_label(subject.label)


def save_worst_case(worst, directory: Path, deviations: Sequence[str] = (), conventions: Sequence[str] = ()) -> str | None:
    """Write the case that drifted most (a `reports.drift.Worst`) as a case file under `directory`,
    with the `deviations` and `conventions` its run declared (meta.json records a fuzz run's);
    the command that replays it (None for runs whose rows predate the stored case)."""
    if not worst.case:
        return None
    case = Case.from_dict(json.loads(worst.case))
    cf = casefile.CaseFile(case, worst.impl_specs, worst.device,
                           note=f"drifted most against the baseline: {worst.label}, {worst.what()}",
                           deviations=tuple(deviations), conventions=tuple(conventions))
    path = casefile.save(directory / f"{casefile.stem(case.op, ','.join(worst.impl_specs), case)}.json", cf)
    return replay_command(path, worst.impl_specs, worst.device, tuple(deviations), conventions=tuple(conventions))


# ----------------------------------------------------------------------------- check


def check(
    op: str,
    impl: Impl = None,
    *,
    examples: int | None = None,
    seed: int | None = None,
    device: str | None = None,
    profile: str | None = None,
    out: str | Path | None = None,
    isolate: bool | None = None,
    timeout: float | None = None,
    deviations: Sequence[str] | None = None,
    conventions: Sequence[str] | Mapping[str, Any] | None = None,
    path: str | None = None,
    world_size: int | None = None,
    shrink: bool = True,
    covering: bool | None = None,
    parallel: int | None = None,
    junit: str | Path | None = None,
    baseline: str | Path | None = None,
    shard: str | Any | None = None,
    corpus: str | Path | None = None,
    sandbox: str = "auto",
    log: Callable[[str], None] | None = None,
) -> CheckResult:
    """Fuzz `impl` on `op` against the reference (or a property, "property:NAME"), shrink the first
    failing case, save it, and return every row.

    Args:
        op: an op of the public contract (`mla-verify list`), "forward_mqa", "dcp" or "property:NAME".
        impl: a callable, "MODULE:CALLABLE", a registered name, {stage: impl} for a pipeline op or a
            property, or None for the project's own implementation.
        examples: cases to draw (default: the profile's budget). seed: the campaign's seed (default:
            random, or inside pytest under CI=true one derived from the commit; `CheckResult.seed`
            says which).
        device: "cpu", "cuda" or "cuda:N" (default: cuda when present). profile: ci | dev | nightly |
            gpu (default: dev on cpu, gpu on cuda). Inside pytest, `--mla-verify-examples`,
            `--mla-verify-device` and `--mla-verify-profile` replace these defaults (the plugin,
            `mla_verify.pytest_plugin`); a value passed here wins.
        out: a run directory to write (rows, meta, failing case files; must not hold a run). None:
            rows stay in memory and a failing case is saved under the temporary directory.
        isolate: run cases in a worker process replaced after a crash, hang or CUDA error, and
            judge them in this one, out of the kernel's reach (default: on whenever `impl` is
            named, "MODULE:CALLABLE" or a registered name, on CPU as on CUDA; a callable object
            runs in this process, and `CheckResult.in_process` says so). timeout: seconds the
            implementation may take per case in the worker (default 300; start-up and the
            reference are not counted). sandbox: the worker's OS boundary, auto | strict | off.
        deviations: documented deviations (equivalence.judge.policy) the implementation declares.
        conventions: the implementation's conventions where they are not the reference's
            (equivalence.judge.conventions): {"lse_base": 2, "empty_lse": "-inf", "max_logits_base": 2}
            or ["lse_base=2", ...]; its LSE and max_logits are converted once, as it returns them.
        path: forward_mqa's path, or a property's target. world_size: dcp's rank count (default 2).
        shrink: minimize the first failing case. covering: False skips the op's covering set (default: it runs
            whole first, or as the baseline's did; the PASS line and meta.json say so; a gate always runs it).
            parallel: independent campaigns, one per GPU, dealt round-robin past the GPU count, each with its
            share of the cores (default: every GPU on cuda). junit: also JUnit XML there. log: hears the header.
        baseline: a run directory of the same op: seed, profile, examples and path default to the
            ones it recorded, so the campaign draws its cases again (`drift` then pairs them).
        shard: "I/N", "auto" (`runs.schedulers`) or a `runs.parts.Shard`: run only shard I of
            N, the campaigns of seeds S + I * P ... of the run's N * P (P: `parallel`); `merge`
            joins the N shards' run directories into the one run a machine with `parallel=N * P`
            would have written.
        corpus: a kept corpus directory (`mla_verify.runs.corpus`): its cases of this op and
            implementation run first, whatever the seed, and the finding is added to it
            (default: `--mla-verify-corpus` inside pytest, else none).

    Raises:
        UsageError: bad input (unknown op, unimportable callable, wrong signature, unwritable out,
            ...), before any case runs.
        HarnessError: mla-verify itself failed; the rows so far are written first.
    """
    __tracebackhide__ = True  # a pytest failure ends at the test's call
    given = {**locals(), "ops": (op,), "device": resolve_device(default_device(device))}  # pytest's options fill gaps
    given.update((name, DEFAULTS.get(name)) for name in ("examples", "profile", "seed", "corpus") if given[name] is None)
    if given["seed"] is None and baseline is None:  # under CI=true, the commit's seed (a baseline's own wins)
        given["seed"] = DEFAULTS.get("commit_seed")
    given["specs"], given["named"] = impl_specs(impl)
    result = run(Options.asked(FUZZ, given, besides=("op", "impl", "log", "__tracebackhide__")), log)
    saved(result.failures)  # listed in a pytest session's summary
    return result


def gate(
    *,
    device: str | None = None,
    profile: str | None = None,
    examples: int | None = None,
    seed: int | None = None,
    ops: Sequence[str] | None = None,
    out: str | Path | None = None,
    isolate: bool | None = None,
    timeout: float | None = None,
    parallel: int | None = None,
    shard: str | Any | None = None,
    baseline: str | Path | None = None,
    junit: str | Path | None = None,
    impl: Sequence[str] | None = None,
    corpus: str | Path | None = None,
    durations: str | Path | None = None,
    sandbox: str = "auto",
    log: Callable[[str], None] | None = None,
) -> GateOutcome:
    """The gate (`mla-verify gate`): every op and forward_mqa path with every implementation
    available on `device`, the pinned corpus, a fuzz budget and every property, into one run
    directory; `GateOutcome` has the rows, `failed`, `out` and what the CLI prints.

    Args:
        ops: only these ops, "property:NAME", or "property" (every property) (default: all).
        examples: fuzz cases per op (or property) and implementation (default: the profile's).
        profile: default ci on cpu, gpu on cuda. seed: default random, or the baseline's.
        out: the run directory (default: a new runs/gate-TIME). isolate, timeout, sandbox: as in `check`.
        parallel: processes, one GPU each, dealt round-robin past the GPU count (default: every
            GPU on cuda, 1 on cpu). shard: "I/N", or "auto" (the scheduler's index and count,
            `runs.schedulers`): every N-th op and implementation from the I-th, or by `durations`
            (`runs.parts`; `merge` joins the shards).
        baseline: an earlier gate run: its seed, profile, examples and ops, unless given.
        junit: also write JUnit XML there. log: receives the run's header lines.
        impl: "OP=MODULE:CALLABLE" / "STAGE=MODULE:CALLABLE" strings: only what these take part in
            (`mla_verify.runs.selection`: their ops, forward_mqa with the stages swapped in, the
            properties that test them) (default: every registered implementation here).
        corpus: a kept corpus directory (`mla_verify.runs.corpus`): the cases of the units that apply
            run first, whatever the seed; every finding is added to it.
        durations: a durations.json (or a run directory holding one) that an earlier gate or merge
            wrote: the shards are sized by each unit's seconds there (`mla_verify.runs.durations`),
            not by count; a path with none yet deals by count.

    Raises UsageError for bad input, before any case runs."""
    given = {**locals(), "ops": tuple(ops or ()), "impls": tuple(impl or ())}
    return run(Options.asked(GATE, given, besides=("impl", "log")), log)


def run(options: Options, log: Callable[[str], None] | None = None) -> CheckResult | GateOutcome:
    """The run `options` ask for (`runs.plan.Options`: what check() and gate() are given, and what
    the CLI's fuzz and gate parse): checked (`runs.plan.plan`), started with its header line on
    `log`, driven, and its JUnit file written where one was asked for."""
    log = log or (lambda line: None)
    planned = plan(options, log)
    try:
        outcome = execute(planned, log)
    finally:
        if planned.out is not None:
            planned.out.release()
    if options.junit is None or outcome.interrupted and options.command == GATE:
        return outcome
    if options.command == GATE:
        write_junit(Path(options.junit), outcome.rows, replays=saved_replays(outcome.out / "failures"))
    else:
        replays = {f.case_file.name: f.replay_command for f in outcome.failures if f.case_file is not None}
        write_junit(Path(options.junit), [Row.from_record(r) for r in outcome.rows.to_dict("records")],
                    replays=replays)
    return outcome


def drift(run: str | Path | Any, baseline: str | Path | Any, *, factor: float | None = None,
          confidence: float | None = None, min_cases: int | None = None,
          pairs: Mapping[str, str] | Sequence[str] | None = None, fail_on: str = "drifted"):
    """`reports.drift.compare` of two runs, each a run directory, a rows DataFrame or a
    CheckResult; settings default to `equivalence.judge.policy` (DRIFT_FACTOR, DRIFT_CONFIDENCE,
    DRIFT_MIN_CASES). `pairs`: {NEW: OLD} or ["NEW=OLD", ...] implementation names to compare across.
    Each group reads drifted, worse, unchanged or better (`Drift.groups["word"]`); exit_code is 1 for
    drifted, and with fail_on="worse" for worse too.

    Raises UsageError for bad settings or when nothing pairs ("nothing comparable")."""
    def rows_of(x, what):
        if isinstance(x, CheckResult):
            return x.rows
        return x if hasattr(x, "columns") else load_run(x, what)[0]

    settings = dict(factor=DRIFT_FACTOR if factor is None else factor,
                    confidence=DRIFT_CONFIDENCE if confidence is None else confidence,
                    min_cases=DRIFT_MIN_CASES if min_cases is None else min_cases)
    try:
        mapping = parse_pairs(list(pairs)) if isinstance(pairs, (list, tuple)) else pairs
        return compare(rows_of(run, "run"), rows_of(baseline, "baseline"), pairs=mapping, fail_on=fail_on, **settings)
    except ValueError as exc:  # PairingError (nothing comparable, a --pair naming no implementation) or a setting
        raise UsageError(str(exc)) from None


def history(runs: Sequence[str | Path], *, html: str | Path | None = None, order: str | Sequence[str] = "time",
            factor: float | None = None, confidence: float | None = None, min_cases: int | None = None,
            fail_on: str = "drifted"):
    """`reports.history.history` of run directories of one kernel line: ordered by "time", as "given",
    or by a list of git revisions; every step between neighbours judged as `drift` judges two runs.
    With `html`, the page (`reports.history_html`), each marked step's worst case saved beside it.
    Raises UsageError for fewer than 2 runs, a run that is not one, or a revision order that misses one."""
    html = writable_file(html, "--html") if html is not None else None
    try:
        h = read_history(runs, order=order, factor=DRIFT_FACTOR if factor is None else factor,
                         confidence=DRIFT_CONFIDENCE if confidence is None else confidence,
                         min_cases=DRIFT_MIN_CASES if min_cases is None else min_cases, fail_on=fail_on)
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    if html is not None:
        write_history(h, html, save_worst_case)
    return h


def assert_equivalent(op: str, impl: Impl = None, **kwargs: Any) -> CheckResult:
    """`check(op, impl, **kwargs)`; on a failure, AssertionError with what the CLI prints (the
    minimized case, failing metric and bound, case file, `mla-verify replay ...`)."""
    __tracebackhide__ = True  # a pytest failure ends at the test's call, not here
    result = check(op, impl, **kwargs)
    if result.interrupted:
        raise KeyboardInterrupt(result.report())
    if not result.passed:
        raise AssertionError(result.report())
    return result


def property_check(name: str, impl: Impl = None, **kwargs: Any) -> CheckResult:
    """`check` of property `name` ("split_invariance" or "property:split_invariance"): the
    implementation held to itself, no reference (`mla-verify list` names each property)."""
    __tracebackhide__ = True
    return check(property_op(name), impl, **kwargs)


# ----------------------------------------------------------------------------- replay


def replay(
    case_file: str | Path,
    impl: Impl = None,
    *,
    device: str | None = None,
    isolate: bool | None = None,
    timeout: float | None = None,
    deviations: Sequence[str] | None = None,
    conventions: Sequence[str] | Mapping[str, Any] | None = None,
    sandbox: str = "auto",
    log: Callable[[str], None] | None = None,
) -> CheckResult:
    """Re-run a saved case exactly, and compare with the failure saved in it.

    The case file is data: it is validated against its op's schema and nothing it names is
    imported. `impl` defaults to the implementation saved with the case when that is a registered
    name; a saved MODULE:CALLABLE must be named again here (it is printed as a hint). `device`
    defaults as in `check` (`--mla-verify-device` inside pytest). `deviations`
    and `conventions` default to the ones saved with the case. `CheckResult.reproduced` says whether the saved
    failure came back (same failing tensors and metrics, values within noise). Isolated (the
    default for a named implementation), `impl` is imported only in its worker, behind `sandbox`
    (as in `check`).
    """
    __tracebackhide__ = True
    device = resolve_device(default_device(device))
    positive("timeout", timeout, float)
    try:
        cf = casefile.load(Path(case_file))
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot replay {case_file}: {exc}") from None
    log = log or (lambda line: None)
    if impl is None:
        foreign = [s for s in cf.impl if ":" in s]
        if foreign:
            raise UsageError(f"{case_file} was saved with --impl {' '.join(cf.impl)}; replay imports only what you "
                             f"name: add --impl {' --impl '.join(foreign)}")
        specs, named = cf.impl, True
    else:
        specs, named = impl_specs(impl)
        if cf.impl and tuple(cf.impl) != specs:
            log(f"  (saved with --impl {' '.join(cf.impl)})")
    deviations = tuple(cf.deviations if deviations is None else deviations)
    own_processes = get_spec(cf.case.op).own_processes
    isolate = default_isolation(isolate, named, own_processes)
    timeout_needs_isolation(timeout, isolate or own_processes)
    if sandbox not in MODES:
        raise UsageError(f"--sandbox {sandbox!r}: expected one of {', '.join(MODES)}")
    subject = resolve_subject(cf.case.op, specs, device_type(device), deviations=deviations, described=isolate,
                              conventions=cf.conventions if conventions is None else conventions)
    label = _label(subject)
    timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
    with Judging(device, isolate, timeout, sandbox) as judging:
        if isolate:  # imported in its worker, never here: UsageError, in one line, where it could not be
            judging.resolve(cf.case.op, specs, deviations, subject.conventions)
        log(f"replay {cf.case.short()} on {device} with {label}" + (f", isolated ({judging.summary()})" if isolate else ""))
        if cf.failure:
            saved = "; ".join(f"{f['tensor']} {f['metric']} = {f['value']:.4g} (bound {f['bound']:.4g})"
                              for f in cf.failure)
            log(f"  saved failure: {saved}"
                + (f" (flaky: failed {cf.flaky[0]} of {cf.flaky[1]} re-runs)" if cf.flaky else ""))
        rows = judging.case(cf.case, subject, RowContext(source="replay", label=label, device=device))
    passed = all(r.passed for r in rows)
    reproduced, note = _reproduced(cf.failure, rows)
    command = replay_command(Path(case_file), specs, device, deviations, timeout, isolate, subject.conventions)
    failures = [] if passed else [Failure.of(cf.case, rows, Path(case_file), command, flaky=cf.flaky,
                                             minimized=bool(cf.failure))]
    return CheckResult(cf.case.op, label, passed, rows_frame(rows), cf.case.seed, 1, None, failures,
                       reproduced=reproduced, notes=[note] if note else [], in_process=not (isolate or own_processes),
                       sandbox=judging.summary())


def _reproduced(saved: list[dict[str, Any]], rows) -> tuple[bool | None, str]:
    """Whether the saved failure came back: the same failing (tensor, metric) pairs, and each
    value within 1e-3 relative of the saved one (noise of atomics and reduction order)."""
    if not saved:
        return None, ""
    now = {(r.tensor, r.gate_metric): r for r in rows if not r.passed}
    if not now:
        return False, "did NOT reproduce: the saved failure passes now"
    missing = [f"{f['tensor']} {f['metric']}" for f in saved if (f["tensor"], f["metric"]) not in now]
    if missing:
        return False, f"did NOT reproduce the same failure: {', '.join(missing)} no longer fail(s) that way"
    moved = [f"{f['tensor']} {f['metric']} {f['value']:.4g} -> {now[f['tensor'], f['metric']].value:.4g}"
             for f in saved if abs(now[f["tensor"], f["metric"]].value - f["value"]) > 1e-3 * max(abs(f["value"]), 1e-30)]
    if moved:
        return True, f"reproduced the failure, but its values moved: {'; '.join(moved)}"
    return True, "reproduced: same failing tensors and metrics, same values"
