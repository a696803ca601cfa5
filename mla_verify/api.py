"""The Python API: what `mla-verify fuzz` and `mla-verify replay` do, as calls a kernel
repository's own pytest suite can make (the CLI is a thin layer over these).

    check(op, impl, ...) -> CheckResult          fuzz an op, pipeline or property against the reference
    assert_equivalent(op, impl, ...)             check(); AssertionError with the CLI's report on failure
    replay(case_file, impl, ...) -> CheckResult  re-run a saved case, and say whether it reproduced
    property_check(name, impl, ...)              check() of a property (needs no reference)
    drift(run, baseline, ...) -> Drift           did the run move away from the exact answer since the baseline?

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
import os
import re
import shlex
import sys
import tempfile
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

from mla_verify.equivalence.isolation import HarnessError, default_isolation
from mla_verify.equivalence.running import Unsupported, unsupported
from mla_verify.equivalence.subject import UsageError

from .interrupt import Interrupt
from .results import CheckResult, Failure

Impl = Union[None, str, Callable, Mapping[str, Union[str, Callable]], Sequence[str]]
DEFAULT_TIMEOUT_S = 300.0
# Callables that cannot be imported by name (lambdas, closures, partials) are reached through
# here in this process: "mla_verify.api:local.NAME" resolves like any MODULE:CALLABLE.
local = types.SimpleNamespace()

__all__ = ["CheckResult", "Failure", "HarnessError", "Unsupported", "UsageError", "assert_equivalent", "check",
           "drift", "property_check", "replay", "unsupported"]

# ----------------------------------------------------------------------------- inputs


def resolve_device(device: str | None) -> str:
    """"cpu", "cuda" or "cuda:N" (None: cuda when present); on CPU the Triton kernels run under
    their interpreter, which must be chosen before any kernel module is imported."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = device.split(":")[0]
    if kind not in ("cpu", "cuda") or (kind == "cpu" and device != "cpu"):
        raise UsageError(f"device {device!r}: expected cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError("device cuda asked for, but no CUDA GPU is visible")
    if kind == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return device


def _positive(name: str, value: float | None, kind: type) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
                              or (kind is int and not isinstance(value, int))):
        raise UsageError(f"{name} must be a positive {'integer' if kind is int else 'number'}, got {value!r}")


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
    return f"{__name__}:local.{name}", False


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
    return re.sub(rf"{re.escape(__name__)}:local\.fn\d+_", "", subject.label)


def replay_command(case_file: Path | None, specs: Sequence[str], device: str, deviations: Sequence[str] = (),
                   timeout: float | None = None, isolate: bool = False, conventions: Sequence[str] = ()) -> str:
    """The command that reproduces a saved failure (isolated where the failure was: a hang or a
    crash replayed in-process would hang or kill the replay)."""
    argv = ["mla-verify", "replay", str(case_file) if case_file else "CASE_FILE"]
    for s in specs:
        argv += ["--impl", "MODULE:CALLABLE" if ".api:local." in s else s]
    for d in deviations:
        argv += ["--deviation", d]
    for c in conventions:
        argv += ["--convention", c]
    argv += ["--device", device.split(":")[0]]
    if isolate and not device.startswith("cuda"):  # isolated by default on cuda
        argv.append("--isolate")
    if timeout is not None and timeout != DEFAULT_TIMEOUT_S:
        argv += ["--timeout", f"{timeout:g}"]
    return shlex.join(argv)


def save_worst_case(worst, directory: Path) -> str | None:
    """Write the case that drifted most (a `reports.drift.Worst`) as a case file under `directory`;
    the command that replays it (None for runs whose rows predate the stored case)."""
    from mla_verify.equivalence.case import Case
    from mla_verify.fuzz import casefile

    if not worst.case:
        return None
    case = Case.from_dict(json.loads(worst.case))
    cf = casefile.CaseFile(case, worst.impl_specs, worst.device,
                           note=f"drifted most against the baseline: {worst.label}, {worst.what()}")
    path = casefile.save(directory / f"{casefile.stem(case.op, ','.join(worst.impl_specs), case)}.json", cf)
    return replay_command(path, worst.impl_specs, worst.device)


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
    parallel: int | None = None,
    junit: str | Path | None = None,
    baseline: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> CheckResult:
    """Fuzz `impl` on `op` against the reference (or a property, "property:NAME"), shrink the first
    failing case, save it, and return every row.

    Args:
        op: an op of the public contract (`mla-verify list`), "forward_mqa", "dcp" or "property:NAME".
        impl: a callable, "MODULE:CALLABLE", a registered name, {stage: impl} for a pipeline op or a
            property, or None for the project's own implementation.
        examples: cases to draw (default: the profile's budget). seed: the campaign's seed (default:
            random; `CheckResult.seed` says which).
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
            reference are not counted).
        deviations: documented deviations (equivalence.policy) the implementation declares.
        conventions: the implementation's conventions where they are not the reference's
            (equivalence.conventions): {"lse_base": 2, "empty_lse": "-inf", "max_logits_base": 2}
            or ["lse_base=2", ...]; its LSE and max_logits are converted once, as it returns them.
        path: forward_mqa's path, or a property's target. world_size: dcp's rank count (default 2).
        shrink: minimize the first failing case. parallel: independent campaigns, one per GPU
            (default: every GPU on cuda). junit: also write JUnit XML there. log: receives the
            run's header line (the CLI prints it).
        baseline: a run directory of the same op: seed, profile, examples and path default to the
            ones it recorded, so the campaign draws its cases again (`drift` then pairs them).

    Raises:
        UsageError: bad input (unknown op, unimportable callable, wrong signature, unwritable out,
            ...), before any case runs.
        HarnessError: mla-verify itself failed; the rows so far are written first.
    """
    from mla_verify.equivalence.catalog import get_spec, resolve_subject
    from mla_verify.equivalence.profiles import get_profile
    from mla_verify.fuzz.campaign import new_seed

    from .pytest_plugin import DEFAULTS, default_device
    from .rundir import RunDir

    # Inside pytest, --mla-verify-profile/-examples/-device fill what the test left unset.
    __tracebackhide__ = True  # a pytest failure ends at the test's call
    examples = DEFAULTS.get("examples") if examples is None else examples
    profile = DEFAULTS.get("profile") if profile is None else profile
    seed = DEFAULTS.get("seed") if seed is None else seed
    device = resolve_device(default_device(device))
    device_type = device.split(":")[0]
    if baseline is not None:
        again = _rerun_settings(baseline, op)
        seed = again["seed"] if seed is None else seed
        profile, examples, path = profile or again["profile"], examples or again["examples"], path or again["path"]
        parallel = parallel or again["campaigns"]
    _positive("examples", examples, int)
    _positive("timeout", timeout, float)
    _positive("parallel", parallel, int)
    try:
        spec = get_spec(op)
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    if world_size is not None and world_size not in spec.ranks:
        raise UsageError(f"--world-size must be one of {', '.join(map(str, spec.ranks))}, got {world_size}"
                         if spec.ranks else f"--world-size: {op} runs in one process")
    world_size = (world_size or spec.ranks[0]) if spec.ranks else None
    specs, named = impl_specs(impl)
    deviations = tuple(deviations or ())
    subject = resolve_subject(op, specs, device_type, deviations=deviations, conventions=conventions)
    path = spec.path_for(path, subject)
    label = _label(subject)
    try:
        prof = get_profile(profile or ("dev" if device_type == "cpu" else "gpu"))
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    examples = examples or spec.examples(prof)
    seed = new_seed() if seed is None else seed
    own_processes = spec.own_processes
    isolate = default_isolation(isolate, named, own_processes)
    _timeout_needs_isolation(timeout, isolate or own_processes)
    timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
    parts = 1 if world_size or not named else (parallel or (_gpu_count() if device_type == "cuda" else 1))
    junit_path = _writable_file(junit, "--junit") if junit is not None else None
    run_dir = RunDir.open(out) if out is not None else None
    plan = _Plan(op=op, specs=specs, label=label, subject=subject, device=device, profile=prof, examples=examples,
                 seed=seed, isolate=isolate, timeout=timeout, deviations=deviations,
                 conventions=subject.conventions, path=path,
                 world_size=world_size, shrink=shrink, run_dir=run_dir, named=named,
                 in_process=not (isolate or own_processes))
    if log is not None:
        where = f", run {run_dir.path}" if run_dir else ""
        ranks = ""
        if world_size:
            from mla_verify.equivalence import distributed

            ranks = f", {world_size} ranks ({distributed.placement(world_size, device_type).describe()})"
        log(f"mla-verify fuzz: op {op}, implementation {label}, {examples} examples, profile {prof.name}, "
            f"device {device}, seed {seed}{ranks}{', isolated' if isolate else ''}{where}"
            + (f"; the cases of baseline {baseline}" if baseline is not None else ""))
    try:
        if parts > 1:
            from .parallel import check_in_parts

            result = check_in_parts(plan, parts, log)
        else:
            result = _campaign(plan)
    finally:
        if run_dir is not None:
            run_dir.release()
    if junit_path is not None:
        from mla_verify.equivalence.rows import Row

        from .junit import write_junit

        replays = {result.failure.case.case_id: result.failure.replay_command} if result.failure else {}
        write_junit(junit_path, [Row.from_record(r) for r in result.rows.to_dict("records")], replays=replays)
    return result


@dataclass
class _Plan:
    op: str
    specs: tuple[str, ...]
    label: str
    subject: Any
    device: str
    profile: Any
    examples: int
    seed: int
    isolate: bool
    timeout: float
    deviations: tuple[str, ...]
    conventions: tuple[str, ...]
    path: str | None
    world_size: int | None
    shrink: bool
    run_dir: Any
    named: bool
    in_process: bool = False  # judged in the implementation's own process (dcp's ranks are processes of their own)
    run_id: str = ""

    def meta(self) -> dict[str, Any]:
        from mla_verify import reports

        # what `check(baseline=...)` reads back to draw the same cases (reports.meta.rerun_settings)
        extra = {"op": self.op, "examples": self.examples, "path": self.path, "isolated": not self.in_process}
        return reports.collect_meta(self.profile.name, [self.seed], self.device,
                                    command=shlex.join(["mla-verify"] + sys.argv[1:]) if sys.argv[1:] else None,
                                    extra=extra)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def load_run(path: str | Path, what: str = "run"):
    """(rows, meta) of a run directory; UsageError where it is missing, unreadable or empty."""
    from mla_verify import reports

    try:
        rows, meta = reports.load_run(path)
    except (OSError, ValueError) as exc:  # missing, empty, truncated or corrupt (pyarrow's errors are ValueErrors)
        raise UsageError(f"{what} {path}: not a readable run ({exc})") from None
    if rows.empty:
        raise UsageError(f"{what} {path}: the run holds no rows")
    return rows, meta


def _rerun_settings(baseline: str | Path, op: str) -> dict[str, Any]:
    from mla_verify.reports.meta import rerun_settings

    rows, meta = load_run(baseline, "baseline")
    name = op.removeprefix("property:")
    ran = set(rows["op"]) | {f"property:{p}" for p in rows.loc[rows["op"] == "property", "path"]}
    if op not in ran and f"property:{name}" not in ran:
        raise UsageError(f"baseline {baseline} holds no rows of {op} (it ran {', '.join(sorted(ran))}): "
                         "nothing comparable")
    return rerun_settings(meta)


def drift(run: str | Path | Any, baseline: str | Path | Any, *, factor: float | None = None,
          confidence: float | None = None, min_cases: int | None = None,
          pairs: Mapping[str, str] | Sequence[str] | None = None):
    """`reports.drift.compare` of two runs, each a run directory, a rows DataFrame or a
    CheckResult; settings default to `equivalence.policy` (DRIFT_FACTOR, DRIFT_CONFIDENCE,
    DRIFT_MIN_CASES). `pairs`: {NEW: OLD} or ["NEW=OLD", ...] implementation names to compare across.

    Raises UsageError for bad settings or when nothing pairs ("nothing comparable")."""
    from mla_verify.equivalence import policy
    from mla_verify.reports.drift import compare
    from mla_verify.reports.pairing import parse_pairs

    def rows_of(x, what):
        if isinstance(x, CheckResult):
            return x.rows
        return x if hasattr(x, "columns") else load_run(x, what)[0]

    settings = dict(factor=policy.DRIFT_FACTOR if factor is None else factor,
                    confidence=policy.DRIFT_CONFIDENCE if confidence is None else confidence,
                    min_cases=policy.DRIFT_MIN_CASES if min_cases is None else min_cases)
    try:
        mapping = parse_pairs(list(pairs)) if isinstance(pairs, (list, tuple)) else pairs
        return compare(rows_of(run, "run"), rows_of(baseline, "baseline"), pairs=mapping, **settings)
    except ValueError as exc:  # PairingError (nothing comparable, a --pair naming no implementation) or a setting
        raise UsageError(str(exc)) from None


def _timeout_needs_isolation(timeout: float | None, stoppable: bool) -> None:
    """A timeout is kept only where the call can be stopped: an isolation worker, or rank processes."""
    if timeout is not None and not stoppable:
        raise UsageError("--timeout needs isolation (the default; not --no-isolate, isolate=False or a callable "
                         "object): an in-process call cannot be stopped, and a timeout that is not kept would let a "
                         "hang pass")


def _writable_file(path: str | Path, what: str) -> Path:
    from mla_verify.reports.store import run_file

    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{what} {path}: a directory, not a file")
    if run_file(path):
        raise UsageError(f"{what} {run_file(path)}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{what} {path}: cannot create its directory ({exc.strerror or exc})") from None
    if not os.access(path.parent, os.W_OK):
        raise UsageError(f"{what} {path}: its directory is not writable")
    return path


def _in_process_runner(plan: _Plan, notes: set[str], lost: list[str]):
    """Evaluate in this process. On CUDA, a context that saw a CUDA error cannot run another case:
    the campaign stops there (`lost`), the case being the implementation's crash."""
    from mla_verify.equivalence import device as dev
    from mla_verify.equivalence.catalog import evaluate, get_spec
    from mla_verify.equivalence.running import failure_row

    def run(case, source: str):
        called: list[bool] = []
        try:
            rows = evaluate(case, plan.subject, plan.device, run_id=plan.run_id, source=source, notes=notes,
                            on_call=lambda: called.append(True))
        except Exception as exc:
            if not (plan.device.startswith("cuda") and called and (dev.is_device_error(exc) or not dev.usable(plan.device))):
                raise
            base = dict(run_id=plan.run_id, case_id=case.case_id, impl=plan.label, stages="", device=plan.device,
                        seed=case.seed, source=source, **get_spec(case.op).identity(case))
            rows = [failure_row(base, "*", "crashed", f"CUDA error after the implementation ran: {dev.first_line(exc)}")]
        if plan.device.startswith("cuda") and not lost and (
                any(r.gate_metric in ("raised", "crashed") and dev.is_device_error(r.reason) for r in rows)
                or not dev.usable(plan.device)):
            lost.append("the CUDA context is unusable after a CUDA error of the implementation; "
                        "run isolated (--isolate) to go on past crashes")
        return rows

    return run


def _campaign(plan: _Plan) -> CheckResult:
    """One campaign in this process (its cases isolated or not), written to the run directory."""
    import time

    from mla_verify.equivalence import contract, distributed
    from mla_verify.equivalence.isolation import HarnessError, Worker
    from mla_verify.equivalence.subject import unexercised
    from mla_verify.fuzz.campaign import fuzz
    from mla_verify.reports import rows_frame

    from .pytest_plugin import DEFAULTS

    plan.run_id = f"fuzz-{time.strftime('%Y%m%d-%H%M%S')}"
    meta = plan.meta()
    run_dir = plan.run_dir
    out_dir = run_dir.path if run_dir else Path(DEFAULTS.get("failures") or Path(tempfile.gettempdir()) / "mla-verify")
    if run_dir:
        run_dir.start(meta)
    rows: list = []
    notes: set[str] = set()
    lost: list[str] = []
    interrupt = Interrupt()
    worker = Worker(plan.device, plan.timeout) if plan.isolate else None
    distributed.set_timeout(plan.timeout)

    def run(case, source):
        if worker is None:
            return runner(case, source)
        rows = worker.run(case, plan.specs, plan.label, plan.run_id, source, notes=notes, deviations=plan.deviations,
                          conventions=plan.conventions)
        for r in rows:
            r.impl = plan.label
        return rows

    runner = _in_process_runner(plan, notes, lost)

    def journal(case_rows):
        rows.extend(case_rows)
        if run_dir:
            run_dir.append(case_rows)

    def stop_reason() -> str:
        return "interrupted" if interrupt.requested else lost[0] if lost else ""

    started = None if run_dir is None else (
        lambda case, source: run_dir.case_started(case, source, run_id=plan.run_id, impl=plan.label, specs=plan.specs,
                                                  device=plan.device, deviations=plan.deviations))

    contract.CALLED_WITH.clear()
    try:
        with interrupt.installed():
            fz = fuzz(plan.op, run, profile=plan.profile, examples=plan.examples, seed=plan.seed,
                      impl_specs=plan.specs, impl_label=plan.label, deviations=plan.deviations,
                      conventions=plan.conventions, device=plan.device,
                      out_dir=out_dir, shrink=plan.shrink, path=plan.path, world_size=plan.world_size,
                      journal=journal, stop_reason=stop_reason, started=started)
    except Exception as exc:
        if run_dir:
            detail = exc.detail if isinstance(exc, HarnessError) else traceback.format_exc()
            run_dir.write_file("harness-error.txt", detail or traceback.format_exc())
            run_dir.finish(rows, meta)
        if isinstance(exc, HarnessError):
            raise
        raise HarnessError(f"harness error: {type(exc).__name__}: {exc}", traceback.format_exc()) from exc
    finally:
        if worker is not None:
            worker.close()
    if run_dir:
        run_dir.finish(rows, {**meta, "stopped": fz.stopped} if fz.stopped else meta)  # a stopped run is no pass
    frame = rows_frame(rows)
    failures = []
    if fz.failure is not None:
        failures.append(Failure.of(fz.failure.case, fz.failure.rows, fz.case_file,
                                   replay_command(fz.case_file, plan.specs, plan.device, plan.deviations, plan.timeout,
                                                  plan.isolate, plan.conventions),
                                   found_at=fz.first_failure_at, seed=plan.seed, flaky=fz.flaky, minimized=fz.shrunk))
    extra = sorted(notes) + [fz.stopped] * (fz.stopped not in ("", "interrupted"))
    extra += unexercised(plan.specs, contract.CALLED_WITH)  # what the replaced stages were never handed
    if plan.world_size:
        extra += [f"worst per rank over {fz.examples} cases: {line}" for line in distributed.worst_by_rank(fz.rows)]
    return CheckResult(plan.op, plan.label, not failures and fz.stopped != "interrupted" and bool(frame.passed.all()),
                       frame, plan.seed, fz.examples, run_dir.path if run_dir else None, failures,
                       interrupted=fz.stopped == "interrupted", notes=extra, in_process=plan.in_process)


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
    return check(name if name.startswith("property:") else f"property:{name}", impl, **kwargs)


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
    log: Callable[[str], None] | None = None,
) -> CheckResult:
    """Re-run a saved case exactly, and compare with the failure saved in it.

    The case file is data: it is validated against its op's schema and nothing it names is
    imported. `impl` defaults to the implementation saved with the case when that is a registered
    name; a saved MODULE:CALLABLE must be named again here (it is printed as a hint). `device`
    defaults as in `check` (`--mla-verify-device` inside pytest). `deviations`
    and `conventions` default to the ones saved with the case. `CheckResult.reproduced` says whether the saved
    failure came back (same failing tensors and metrics, values within noise).
    """
    from mla_verify.equivalence.catalog import evaluate, get_spec, resolve_subject
    from mla_verify.equivalence.isolation import Worker
    from mla_verify.fuzz import casefile
    from mla_verify.reports import rows_frame

    from .pytest_plugin import default_device

    __tracebackhide__ = True
    device = resolve_device(default_device(device))
    device_type = device.split(":")[0]
    _positive("timeout", timeout, float)
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
    subject = resolve_subject(cf.case.op, specs, device_type, deviations=deviations,
                              conventions=cf.conventions if conventions is None else conventions)
    label = _label(subject)
    own_processes = get_spec(cf.case.op).own_processes
    isolate = default_isolation(isolate, named, own_processes)
    _timeout_needs_isolation(timeout, isolate or own_processes)
    timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
    log(f"replay {cf.case.short()} on {device} with {label}{', isolated' if isolate else ''}")
    if cf.failure:
        saved = "; ".join(f"{f['tensor']} {f['metric']} = {f['value']:.4g} (bound {f['bound']:.4g})" for f in cf.failure)
        log(f"  saved failure: {saved}" + (f" (flaky: failed {cf.flaky[0]} of {cf.flaky[1]} re-runs)" if cf.flaky else ""))
    if isolate:
        worker = Worker(device, timeout)
        try:
            rows = worker.run(cf.case, specs, label, source="replay", deviations=deviations,
                              conventions=subject.conventions)
        finally:
            worker.close()
    else:
        rows = evaluate(cf.case, subject, device, source="replay")
    passed = all(r.passed for r in rows)
    reproduced, note = _reproduced(cf.failure, rows)
    command = replay_command(Path(case_file), specs, device, deviations, timeout, isolate, subject.conventions)
    failures = [] if passed else [Failure.of(cf.case, rows, Path(case_file), command, flaky=cf.flaky,
                                             minimized=bool(cf.failure))]
    return CheckResult(cf.case.op, label, passed, rows_frame(rows), cf.case.seed, 1, None, failures,
                       reproduced=reproduced, notes=[note] if note else [], in_process=not (isolate or own_processes))


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
