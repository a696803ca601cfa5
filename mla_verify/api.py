"""The Python API: what `mla-verify fuzz`, `gate` and `replay` do, as calls a kernel
repository's own pytest suite can make (the CLI parses arguments into these and prints).

    check(op, impl, ...) -> CheckResult          fuzz an op, pipeline or property against the reference
    assert_equivalent(op, impl, ...)             check(); AssertionError with the CLI's report on failure
    replay(case_file, impl, ...) -> CheckResult  re-run a saved case, and say whether it reproduced
    property_check(name, impl, ...)              check() of a property (needs no reference)
    drift(run, baseline, ...) -> Drift           did the run move away from the exact answer since the baseline?
    history(runs, html=...) -> History           many runs of one kernel line: trend and marked steps
    gate(...) -> GateOutcome                     every op and implementation here: the CI gate

check() and gate() validate their arguments into one `Run` (mla_verify.run), which `drive` runs:
in this process, or in parts on this host's GPUs; a shard (shard="I/N") runs its share of it.

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
import types
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

from mla_verify.equivalence.isolation import HarnessError, default_isolation
from mla_verify.equivalence.running import Unsupported, unsupported
from mla_verify.equivalence.subject import UsageError, did_you_mean

from .results import DEFAULT_TIMEOUT_S, CheckResult, Failure, GateOutcome, replay_command
from .run import FUZZ, GATE, Run, drive, invocation

Impl = Union[None, str, Callable, Mapping[str, Union[str, Callable]], Sequence[str]]
# Callables that cannot be imported by name (lambdas, closures, partials) are reached through
# here in this process: "mla_verify.api:local.NAME" resolves like any MODULE:CALLABLE.
local = types.SimpleNamespace()

__all__ = ["CheckResult", "Failure", "GateOutcome", "HarnessError", "Unsupported", "UsageError", "assert_equivalent",
           "check", "drift", "gate", "history", "property_check", "replay", "unsupported"]

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


def save_worst_case(worst, directory: Path, deviations: Sequence[str] = (), conventions: Sequence[str] = ()) -> str | None:
    """Write the case that drifted most (a `reports.drift.Worst`) as a case file under `directory`,
    with the `deviations` and `conventions` its run declared (meta.json records a fuzz run's);
    the command that replays it (None for runs whose rows predate the stored case)."""
    from mla_verify.equivalence.case import Case
    from mla_verify.fuzz import casefile

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
    parallel: int | None = None,
    junit: str | Path | None = None,
    baseline: str | Path | None = None,
    shard: str | Any | None = None,
    corpus: str | Path | None = None,
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
        shrink: minimize the first failing case. parallel: independent campaigns, one per GPU,
            dealt round-robin past the GPU count, each with its share of the cores (default: every
            GPU on cuda). junit: also write JUnit XML there. log: receives the
            run's header line (the CLI prints it).
        baseline: a run directory of the same op: seed, profile, examples and path default to the
            ones it recorded, so the campaign draws its cases again (`drift` then pairs them).
        shard: "I/N" (or a `fuzz.shard.Shard`): run only shard I of N, the campaigns of seeds
            S + I * P ... of the run's N * P (P: `parallel`); `merge` joins the N shards' run
            directories into the one run a machine with `parallel=N * P` would have written.
        corpus: a kept corpus directory (`mla_verify.corpus`): its cases of this op and
            implementation run first, whatever the seed, and the finding is added to it
            (default: `--mla-verify-corpus` inside pytest, else none).

    Raises:
        UsageError: bad input (unknown op, unimportable callable, wrong signature, unwritable out,
            ...), before any case runs.
        HarnessError: mla-verify itself failed; the rows so far are written first.
    """
    from mla_verify.equivalence.catalog import get_spec, resolve_subject
    from mla_verify.equivalence.profiles import get_profile
    from mla_verify.fuzz.campaign import new_seed
    from mla_verify.fuzz.shard import Shard

    from .pytest_plugin import DEFAULTS, default_device, saved
    from .rundir import RunDir

    # Inside pytest, --mla-verify-profile/-examples/-device fill what the test left unset.
    __tracebackhide__ = True  # a pytest failure ends at the test's call
    examples = DEFAULTS.get("examples") if examples is None else examples
    profile = DEFAULTS.get("profile") if profile is None else profile
    kept = open_corpus(DEFAULTS.get("corpus") if corpus is None else corpus)
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
        shard = Shard.parse(shard)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
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
    if shard.index * parts >= examples:  # its first campaign, slot I * P, has no share of the examples
        raise UsageError(f"shard {shard}: {examples} examples over {shard.count * parts} campaigns leave it none "
                         f"(give at least {shard.count * parts} examples)")
    junit_path = _writable_file(junit, "--junit") if junit is not None else None
    run_dir = RunDir.open(out) if out is not None else None
    run = Run(FUZZ, (op,), device, prof, examples, seed, isolate, timeout, out=run_dir, baseline=baseline,
              shard=shard, parts=parts, specs=specs, subject=subject, label=label, deviations=deviations,
              conventions=tuple(subject.conventions), path=path,
              world_size=world_size, shrink=shrink, named=named, in_process=not (isolate or own_processes),
              invocation=invocation(), corpus=kept, corpus_replay=shard.index == 0)
    if log is not None:
        log(run.header())
    try:
        result = drive(run, log)
    finally:
        if run_dir is not None:
            run_dir.release()
    saved(result.failures)  # listed in a pytest session's summary
    if junit_path is not None:
        from mla_verify.equivalence.rows import Row

        from .junit import write_junit

        replays = {result.failure.case.case_id: result.failure.replay_command} if result.failure else {}
        write_junit(junit_path, [Row.from_record(r) for r in result.rows.to_dict("records")], replays=replays)
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
    log: Callable[[str], None] | None = None,
) -> GateOutcome:
    """The gate (`mla-verify gate`): every op and forward_mqa path with every implementation
    available on `device`, the pinned corpus, a fuzz budget and every property, into one run
    directory; `GateOutcome` has the rows, `failed`, `out` and what the CLI prints.

    Args:
        ops: only these ops, "property:NAME", or "property" (every property) (default: all).
        examples: fuzz cases per op (or property) and implementation (default: the profile's).
        profile: default ci on cpu, gpu on cuda. seed: default random, or the baseline's.
        out: the run directory (default: a new runs/gate-TIME). isolate, timeout: as in `check`.
        parallel: processes, one GPU each, dealt round-robin past the GPU count (default: every
            GPU on cuda, 1 on cpu). shard: "I/N",
            every N-th op and implementation from the I-th (`fuzz.shard`; `merge` joins the shards).
        baseline: an earlier gate run: its seed, profile, examples and ops, unless given.
        junit: also write JUnit XML there. log: receives the run's header lines.
        impl: "OP=MODULE:CALLABLE" / "STAGE=MODULE:CALLABLE" strings: only what these take part in
            (`mla_verify.selection`: their ops, forward_mqa with the stages swapped in, the
            properties that test them) (default: every registered implementation here).
        corpus: a kept corpus directory (`mla_verify.corpus`): the cases of the units that apply
            run first, whatever the seed; every finding is added to it.

    Raises UsageError for bad input, before any case runs."""
    from mla_verify.equivalence import catalog
    from mla_verify.equivalence.profiles import get_profile
    from mla_verify.fuzz.campaign import new_seed
    from mla_verify.fuzz.gate import shard_units
    from mla_verify.fuzz.shard import Shard

    from .rundir import FreshDir, RunDir
    from .selection import impl_units

    log = log or (lambda line: None)
    device = resolve_device(device)
    device_type = device.split(":")[0]
    known = [*catalog.names(), "property"]
    unknown = [op for op in ops or [] if op not in known]
    if unknown:
        raise UsageError(f"--op {unknown[0]!r}: unknown; {did_you_mean(unknown[0], known)}known: {', '.join(known)}")
    junit_path = _writable_file(junit, "--junit") if junit is not None else None
    ops = list(ops) if ops else None
    if baseline is not None:  # run the baseline's cases again, so that drift pairs them
        from mla_verify.reports.meta import rerun_settings

        again = rerun_settings(load_run(baseline, "baseline")[1])
        seed = again["seed"] if seed is None else seed
        profile, examples, ops = profile or again["profile"], examples or again["examples"], ops or again["ops"]
        log(f"baseline {baseline}: its cases again (seed {seed}, profile {profile}"
            f"{', ops ' + ' '.join(ops) if ops else ''})")
    _positive("examples", examples, int)
    _positive("timeout", timeout, float)
    _positive("parallel", parallel, int)
    try:
        prof = get_profile(profile or ("ci" if device_type == "cpu" else "gpu"))
        shard = Shard.parse(shard)
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    impls = tuple(impl or ())
    chosen = impl_units(impls, device, ops) if impls else None
    kept = open_corpus(corpus)
    if not shard_units(ops, device, shard, chosen):
        raise UsageError(f"--shard {shard}: the gate has fewer units (ops and implementations) than shards here")
    seed = new_seed() if seed is None else seed
    parts = parallel or (_gpu_count() if device_type == "cuda" else 1)
    isolate = default_isolation(isolate, named=True)  # the gate runs registered implementations
    if timeout is not None and not isolate:
        raise UsageError("--timeout needs isolation (the default; not --no-isolate): an in-process call cannot be stopped")
    run_dir = RunDir.open(out if out is not None else FreshDir.named("runs", "gate"))
    run = Run(GATE, tuple(ops or ()), device, prof, examples, seed, isolate,
              DEFAULT_TIMEOUT_S if timeout is None else float(timeout), out=run_dir, baseline=baseline, shard=shard,
              parts=parts, invocation=invocation(), impls=impls, corpus=kept)
    log(run.header())
    outcome = drive(run, log)
    if junit_path is not None and not outcome.interrupted:
        from .junit import saved_replays, write_junit

        write_junit(junit_path, outcome.rows, replays=saved_replays(outcome.out / "failures"))
    return outcome


def open_corpus(directory: str | Path | None) -> str | None:
    """The kept corpus's absolute path as a Run holds it, its files read and checked now (a
    usage error names a bad one before any case runs); None for none."""
    if directory is None:
        return None
    from .corpus import Corpus

    corpus = Corpus(directory)
    corpus.cases()
    return str(corpus.directory)


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
          pairs: Mapping[str, str] | Sequence[str] | None = None, fail_on: str = "drifted"):
    """`reports.drift.compare` of two runs, each a run directory, a rows DataFrame or a
    CheckResult; settings default to `equivalence.policy` (DRIFT_FACTOR, DRIFT_CONFIDENCE,
    DRIFT_MIN_CASES). `pairs`: {NEW: OLD} or ["NEW=OLD", ...] implementation names to compare across.
    Each group reads drifted, worse, unchanged or better (`Drift.groups["word"]`); exit_code is 1 for
    drifted, and with fail_on="worse" for worse too.

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
    from mla_verify.equivalence import policy
    from mla_verify.reports.history import history as read
    from mla_verify.reports.history_html import write_history

    html = _writable_file(html, "--html") if html is not None else None
    try:
        h = read(runs, order=order, factor=policy.DRIFT_FACTOR if factor is None else factor,
                 confidence=policy.DRIFT_CONFIDENCE if confidence is None else confidence,
                 min_cases=policy.DRIFT_MIN_CASES if min_cases is None else min_cases, fail_on=fail_on)
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    if html is not None:
        write_history(h, html, save_worst_case)
    return h


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
