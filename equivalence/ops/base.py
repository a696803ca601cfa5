"""An op of the public contract as a Spec (`equivalence.spec`): how to build its inputs from a
Case, what the reference says, how to call an implementation, and which tensors to compare.

`OpSpec` is an op with one stage in the registry (`optimized.registry`): a subject is one
implementation of that stage. The pipelines (`ops.forward`, `ops.dcp`) extend it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch
from hypothesis import strategies as st

from mla_verify.optimized import registry

from ..cases import cost
from ..cases.builders import stamped
from ..cases.case import Case
from ..cases.draws import SEEDS
from ..cases.profiles import Profile
from ..contracts import arguments as contract_arguments
from ..judge.localize import Axes, axes_for, dims_of
from ..judge.oracle import judge_many
from ..judge.rows import FailureKind, Row, RowContext, RowKind, Stages
from ..sandbox import device as dev, guards
from ..sandbox.call_guards import Snapshot, changed_together, output_problem, tensors_in
from ..sandbox.produced import Produced
from ..sandbox.calls import (
    Raised,
    after_return_rows,
    call_implementation,
    failure_row,
    input_rows,
    judged_row,
    noted,
    patched_error,
    raised_row,
    timed,
)
from ..cases.schema import Params
from ..errors import UsageError
from ..subject import Subject, implementation


BLOCK_BYTES = 4 << 30  # the inputs of a block's cases held at once (their snapshots as much again)
# What judging a check holds at once: its cases' float64 passes (`metrics.outputs` keeps about a
# dozen tensors of the compared one's size alive), in chunks of cases within the budget.
JUDGE_BYTES, JUDGE_BYTES_PER_ELEMENT = 2 << 30, 96


class BoundKey(NamedTuple):
    """Where a reference keeps a tensor of derived per-element bounds (equivalence.judge.bounds): the
    bound's name (a check's `bound`) and the deviation whose rounding it allows ("" for none)."""

    name: str
    deviation: str = ""


@dataclass(frozen=True)
class Check:
    tensor: str            # name in the reference's and the implementation's outputs
    kind: str              # policy kind: exact | out | lse
    scale: str | None = None  # reference tensor of per-row scales: an LSE's logit_l1, an output's value_max
    optional: bool = False    # compared only when the implementation returns it (max_logits)
    single_rank: bool = False  # one DCP rank's pre-combine partial: held to the bounds without DCP
    dtype: torch.dtype | None = None  # the contract's dtype (None: the reference's, for exact tensors)
    contiguous: bool = False   # the contract asks for a dense tensor (a later kernel reads it so)
    row_kind: RowKind | None = None  # its rows' kind (equivalence.judge.rows) where not the policy kind's own
    # the name of the reference's tensors of derived per-element bounds (equivalence.judge.bounds), kept
    # under BoundKey(bound, deviation): held to elem_bound_ratio <= 1
    bound: str | None = None
    rank: int | None = None    # the DCP rank whose tensor it is (its rows say so)

    def bounds_in(self, ref: Mapping[str, Any]) -> dict[str, Any] | None:
        """The reference's bound tensors (the values of `ref` by key) of this check by deviation
        ("" none), or None."""
        if self.bound is None:
            return None
        return {key.deviation: t for key, t in ref.items() if isinstance(key, BoundKey) and key.name == self.bound}


@dataclass
class ImplOutput:
    tensors: dict[str, torch.Tensor]
    stages: Stages = ()              # (stage, impl) pairs when a pipeline ran
    deviations: tuple[str, ...] = ()
    path: str | None = None          # the path the implementation reports it took
    notes: tuple[str, ...] = ()      # e.g. "sparse_prefill: flash_mla: runs on cuda, not cpu"


@dataclass(frozen=True)
class OpSpec:
    name: str
    stage: str | None                 # registry stage of the project's implementation (None: a pipeline)
    params: type[Params]              # a case's params, typed (replay validates a file against it)
    draw: Callable[[Profile], st.SearchStrategy[dict]]              # the params a fuzz profile draws
    inputs: Callable[[Any, int, str], dict[str, Any]]              # (params, seed, device) -> kwargs
    reference: Callable[[dict[str, Any], Any], dict[str, torch.Tensor]]  # (kwargs, params)
    call: Callable[[Any, dict[str, Any], Any], ImplOutput]         # (Subject, kwargs, params)
    checks: tuple[Check, ...]
    knobs: Callable[[Any], dict[str, Any]] = field(default=lambda p: {})
    # (kwargs, tensor, impl's, reference's) -> where a NaN the reference lacks came from, or "":
    # the inputs' own account of a failure (which entry past a token's length a kernel read)
    explain_nan: Callable[[dict, str, torch.Tensor, torch.Tensor], str] | None = None
    path: Callable[[Any], str] | None = None
    doc: str = ""
    # Runs its implementation in processes of its own, each isolated already: never inside an
    # isolation worker (a daemonic worker process cannot start children).
    own_processes: bool = False
    # Arguments written in place (their bytes are the op's checks). The reference answers after
    # the calls, so it reads none of what these hold (only their geometry).
    writes: tuple[str, ...] = ()
    # The inputs of a block's cases (one params) as one problem the reference answers at once (None
    # where these cases cannot be): every tensor of its answer is then the cases' answers
    # concatenated along dim 0.
    stack: Callable[[list[dict[str, Any]]], dict[str, Any] | None] | None = None
    views: bool = False               # the result may be a view of an input (the reshapes)
    family: str = "op"
    ranks: tuple[int, ...] = ()

    @property
    def arguments(self) -> tuple[str, ...]:
        """The keyword arguments every implementation is called with (`equivalence.contracts`)."""
        return contract_arguments(self.name)

    @property
    def tag(self) -> str:
        """What `mla-verify list` shows beside the name."""
        return self.stage or "pipeline of stages"

    def facts(self, device: str) -> list[str]:
        """The lines `mla-verify list` shows under the doc."""
        return [f"keywords: {', '.join(self.arguments)}", f"reference: mla_verify.reference.{self.name}"]

    def axes(self, tensor: str, kwargs: Mapping[str, Any]) -> Axes | None:
        """The names of returned `tensor`'s dimensions for a call with `kwargs` (`localize`)."""
        return axes_for(self.name, tensor, [c.tensor for c in self.checks], kwargs)

    def params_of(self, data: Mapping) -> Params:
        """A case's params (its JSON) as the op's dataclass."""
        return self.params.of(data)

    def path_of(self, params: Params) -> str:
        return self.path(params) if self.path else self.name

    def validate(self, params: Mapping) -> None:
        self.params.parse(self.name, params)

    def strategy(self, profile: Profile, path: str | None = None, world_size: int | None = None) -> st.SearchStrategy[Case]:
        if path is not None:
            raise KeyError(f"{self.name} has no paths; --path applies to a pipeline or a property")
        if world_size is not None:
            raise KeyError(f"{self.name} runs in one process; --world-size applies to an op of ranks")
        return st.builds(lambda p, seed: Case(self.name, stamped(self.params, p), seed), self.draw(profile), SEEDS)

    def examples(self, profile: Profile) -> int:
        return profile.examples

    def interpreted_s(self, params: Params) -> float:
        """The Triton interpreter's seconds for a case (equivalence.cases.cost)."""
        return cost.interpreted_s(params)

    def identity(self, case: Case, params: Params | None = None) -> dict[str, Any]:
        """The op, path, case and knob columns of `case`'s rows (`params`: its params, typed already)."""
        params = self.params_of(case.params) if params is None else params
        return dict(op=self.name, path=self.path_of(params), case=json.dumps(case.to_dict(), sort_keys=True),
                    **self.knobs(params))

    def subject(self, specs: Sequence[str], device: str, deviations: Sequence[str] = ()) -> Subject:
        """One implementation of the op's stage: the registry's preferred one, one named, or a
        user's MODULE:CALLABLE (also written STAGE=...)."""
        if len(specs) > 1:
            raise UsageError(f"op {self.name} takes one --impl, got {len(specs)}")
        if specs:
            target = specs[0].split("=", 1)[1] if "=" in specs[0] else specs[0]
            impl = implementation(self.stage, target, device, deviations)
        else:
            try:
                impl = registry.select(self.stage, device)
            except RuntimeError as exc:
                raise UsageError(str(exc)) from None
        return Subject(impl.name, impl.fn, deviations=impl.deviations, specs=tuple(specs), declared=tuple(deviations))

    def subjects(self, device: str) -> dict[str, tuple[str, ...]]:
        """Every registered implementation of the stage that runs on `device`, by name."""
        return {impl.name: (impl.name,) for impl in registry.implementations(self.stage) if impl.why_not(device) is None}

    def campaigns(self, subject: Subject) -> list[str | None]:
        return [None]

    def path_for(self, path: str | None, subject: Subject) -> str | None:
        if path is not None:
            raise UsageError(f"--path applies to a pipeline (forward_mqa) or a property, not {self.name}")
        return None

    def evaluate(self, case: Case, subject: Subject, context: RowContext) -> list:
        """Every checked tensor of `case` as a Row (a single failure row if the implementation
        raised), judged in this process: `evaluate_block` of one case."""
        return self.evaluate_block([case], subject, context)[0]

    def evaluate_block(self, cases: Sequence[Case], subject: Subject, context: RowContext) -> list[list]:
        """The rows of each of `cases`, cases of one params whose seeds differ (a fuzz block),
        judged in this process. Each case's inputs are built from its seed, as its replay builds
        them, and snapshotted before any call of the block; the implementation runs once per case,
        on its own inputs; then the reference answers the block, in one call where the op stacks
        its cases (`stack`), on the inputs as built (bytes a call wrote where it must not are put
        back first): no call can reach an answer that does not exist yet. Each check is judged over
        the block at once (`oracle.judge_many`). The context's `notes` collect what the
        implementation side reported (a stage that fell back to a portable implementation); its
        `on_call` runs before each call of the implementation, once its inputs are ready, on
        `context.device`. A call that leaves the CUDA context
        unusable ends the block: its case's rows are its last, and every other case of it is None
        (not judged: what it returned lived on that context)."""
        params = self.params_of(cases[0].params)
        found: list[list | None] = []
        for part, kwargs in self._in_parts(cases, params, context.device):
            rows, lost = self._evaluate_part(part, kwargs, subject, params, context)
            del kwargs  # not held while the next part is built
            found += rows
            if lost:
                return found + [None] * (len(cases) - len(found))
        return found

    def _evaluate_part(self, part: list[Case], kwargs: list[dict], subject: Subject, params: Params,
                       context: RowContext) -> tuple[list[list | None], bool]:
        """`evaluate_block` of a part of a block, its inputs built: (each case's rows, whether a call
        lost the CUDA context: then only the cases called so far have an entry, None where not judged)."""
        # Taken before the block's first call: a call writing another case's inputs shows too.
        snapshots = [Snapshot(kw) for kw in kwargs]
        bases, outcomes, lost, last = self._calls(part, kwargs, snapshots, subject, params, context)
        if lost:  # nothing after the case that lost the context runs, and nothing is judged
            return [o if isinstance(o, list) else None for o in outcomes], True
        called = [i for i, o in enumerate(outcomes) if isinstance(o, _Called)]
        t_ref, verdict_of = math.nan, {}
        if called:
            # After the block's last call, read back at once: a write shows on the inputs it hit.
            for i, written in zip(called, changed_together([snapshots[i] for i in called], self.writes)):
                outcomes[i].rows = input_rows(bases[i], written, **outcomes[i].times)
            for inputs in snapshots:
                inputs.put_back()
            answer, t_ref = timed(lambda: self._answer(kwargs, params), context.device)
            t_ref /= len(part)

            def problem(i: int, name: str, out: Any, want: torch.Tensor, check: Check) -> str | None:
                return self._output_problem(check, out, want) or outcomes[i].shared.get(name)

            everyone = [o if isinstance(o, _Called) else _Called.none() for o in outcomes]
            verdict_of = self._verdicts(called, bases, params, kwargs, answer, [o.tensors for o in everyone],
                                        [o.deviations for o in everyone], [o.times for o in everyone], problem)
        if last is not None:  # the block's last call, checked once its outputs were judged
            outcomes[last[0]].after = last[1].changed(outcomes[last[0]].threads)
        found = []
        for i, o in enumerate(outcomes):
            rows = o.rows + verdict_of[i] if isinstance(o, _Called) else o
            if isinstance(o, _Called):
                rows = noted(rows + after_return_rows(bases[i], o.after, **o.times), [t.name for t in o.threads])
            for r in rows:
                r.time_ref_s = t_ref
            found.append(rows)
        return found, False

    def _calls(self, part: list[Case], kwargs: list[dict], snapshots: list[Snapshot], subject: Subject, params: Params,
               context: RowContext) -> tuple[list[dict], list, bool, tuple | None]:
        """Each case of a part called once, in order: (its rows' bases, its outcome: `_Called` or
        its failure rows, whether a call left the CUDA context unusable: it is then the last, and
        the last call's (position, `guards.Returned`) still to check for a write after return). The
        judge's names are checked once, after the part's last call (nothing of ours judges before
        it); a patch there fails every case called, as they share the implementation and params.
        A copy of the outputs is taken at return (what a block judges); the storage returned is
        compared with it before the next call."""
        bases, outcomes, lost, last = [], [], False, None
        with guards.Watch(judge_each_call=len(part) == 1) as watch:
            try:
                for case, kw, inputs in zip(part, kwargs, snapshots):
                    if last is not None:
                        outcomes[last[0]].after, last = last[1].changed(outcomes[last[0]].threads), None
                    base = context.base(case, self.identity(case, params))
                    try:
                        got, t_impl = call_implementation(lambda: self.call(subject, kw, params), case.seed,
                                                          context.device, context.on_call, watch)
                    except Raised as raised:  # the implementation's failure is the case's result, not ours
                        bases.append(base)
                        outcomes.append([raised_row(base, raised)])
                        lost = not dev.usable(context.device)
                        if lost:
                            break
                        continue
                    if context.notes is not None:
                        context.notes.update(got.notes)
                    base = {**base, "path": got.path or base["path"], "stages": got.stages}
                    bases.append(base)
                    # Memory an output shares with an input is told on what was returned; what is judged
                    # after the block's later calls is a copy of its own (a kernel returning its static
                    # buffer overwrites it with the next call).
                    shared = {} if self.views else {n: why for n, out in got.tensors.items()
                                                    if (why := inputs.aliased_by(n, out))}
                    # one that is an input's memory changes when the inputs are put back: told as shared
                    returned = guards.Returned.of({n: t for n, t in got.tensors.items() if n not in shared},
                                                  guards.owned(got.tensors))
                    outcomes.append(_Called(returned.copies if len(part) > 1 else got.tensors, got.deviations,
                                            dict(time_impl_s=t_impl), [], shared, threads=watch.threads_left))
                    last = (len(outcomes) - 1, returned)
            finally:  # put back whatever ended the calls
                patched = [] if watch.judge_each_call else watch.judge.restore()
        if patched:
            error = Raised(patched_error(patched, f" in a call of a block of {len(part)} cases"))
            outcomes = [[raised_row(base, error)] if isinstance(o, _Called) else o for base, o in zip(bases, outcomes)]
            last = None
        return bases, outcomes, lost, last

    def _in_parts(self, cases: Sequence[Case], params: Params, device: str) -> Iterator[tuple[list[Case], list[dict]]]:
        """The cases of a block with their inputs, in parts whose inputs stay within BLOCK_BYTES
        together (the stacked reference holds as much again)."""
        first: dict | None = self.inputs(params, cases[0].seed, device)
        per = max(1, BLOCK_BYTES // max(1, _nbytes(first)))
        for start in range(0, len(cases), per):
            part = list(cases[start:start + per])
            kwargs = [first if start == i == 0 else self.inputs(params, c.seed, device) for i, c in enumerate(part, start)]
            first = None
            yield part, kwargs
            del kwargs  # the next part is built without this one held here

    def _answer(self, kwargs: list[dict], params: Params) -> "Answer":
        """The reference's answer for each case of a block: one call on the cases stacked where the
        op stacks them, else a call per case."""
        together = self.stack(kwargs) if self.stack is not None and len(kwargs) > 1 else None
        if together is not None:
            stacked = {name: t.unflatten(0, (len(kwargs), -1)) for name, t in self.reference(together, params).items()}
            return Answer([{name: t[i] for name, t in stacked.items()} for i in range(len(kwargs))], stacked)
        refs = [self.reference(kw, params) for kw in kwargs]
        return Answer(refs, {name: t[None] for name, t in refs[0].items()} if len(refs) == 1 else {})

    def _output_problem(self, check: Check, out: Any, want: torch.Tensor, returned_on: str | None = None,
                        returned_strides: Sequence[int] | None = None) -> str | None:
        return output_problem(check.tensor, out, dtype=check.dtype or want.dtype, shape=want.shape,
                              # where the exact answer lives (host-side ops answer on the host);
                              # rank answers come back through the host
                              device=None if self.own_processes else str(want.device),
                              contiguous=check.contiguous, returned_on=returned_on, returned_strides=returned_strides,
                              dims=dims_of(self.name, check.tensor, [c.tensor for c in self.checks]))

    def _verdicts(self, at: Sequence[int], bases: list[dict], params: Params, kwargs: list[dict], answer: "Answer",
                  tensors: list, deviations: list, times: list[dict], problem: Callable) -> dict[int, list]:
        """The rows of the cases `at` (positions in the block's lists), a row per check: missing, a
        broken contract (`problem(i, name, out, want, check)`), or the oracle's verdict against the
        reference. The cases of a check that declare the same deviations are judged at once, in
        chunks within JUDGE_BYTES."""
        rows: dict[int, list] = {i: [] for i in at}
        numerics = params.numerics()
        for check in self.checks:
            groups: dict[tuple, list[int]] = {}
            kind = check.row_kind or check.kind
            for i in at:
                want, got = answer.cases[i].get(check.tensor), tensors[i]
                if want is None or (check.optional and check.tensor not in got):
                    continue  # not asked for by this case, or not produced by this implementation
                if check.tensor not in got:
                    rows[i].append(failure_row(bases[i], check.tensor, FailureKind.MISSING,
                                               f"the implementation returned no {check.tensor!r}", kind=kind,
                                               rank=check.rank, **times[i]))
                    continue
                why = problem(i, check.tensor, got[check.tensor], want, check)
                if why:
                    rows[i].append(failure_row(bases[i], check.tensor, FailureKind.CONTRACT, why, kind=kind, rank=check.rank,
                                               **times[i]))
                    continue
                groups.setdefault((tuple(deviations[i]), tuple(want.shape)), []).append(i)
            judged = []
            for (declared, shape), group in groups.items():
                per = max(1, JUDGE_BYTES // (JUDGE_BYTES_PER_ELEMENT * max(1, math.prod(shape))))
                for chunk in (group[start:start + per] for start in range(0, len(group), per)):
                    outs = [tensors[i][check.tensor] for i in chunk]
                    bounds = {dev: answer.of(name, chunk) for dev, name in (check.bounds_in(answer.names()) or {}).items()}
                    judged += zip(chunk, outs, judge_many(
                        check.kind, outs, answer.of(check.tensor, chunk),
                        numerics.replace(dcp_size=1) if check.single_rank else numerics, declared,
                        answer.of(check.scale, chunk), bounds if check.bound else None, name=check.tensor,
                        axes=lambda j, chunk=chunk, name=check.tensor: self.axes(name, kwargs[chunk[j]])))
            for i, out, v in judged:
                if v.metrics.nan_count and self.explain_nan is not None:
                    why = self.explain_nan(kwargs[i], check.tensor, out, answer.cases[i][check.tensor])
                    v.reason = "; ".join(filter(None, (v.reason, why)))
                rows[i].append(judged_row(bases[i], check.tensor, kind, v, rank=check.rank, **times[i]))
        return rows

    def produce(self, case: Case, subject: Subject, context: RowContext, inputs: dict[str, Any] | None = None) -> Produced:
        """The implementation's side of `case`, for a judge in another process (an isolation
        worker's parent): its outputs on the host with the device each came back on, and the
        rows and reasons this side alone can give (it raised, wrote an input, returned something
        that is not a plain dense tensor, or an input). No reference is computed here: the
        implementation never sees it. `inputs`: the case's arguments as the judge built them (handed
        over), else built here."""
        params, device = self.params_of(case.params), context.device
        base = context.base(case, self.identity(case, params))
        kwargs = self.inputs(params, case.seed, device) if inputs is None else inputs
        inputs = Snapshot(kwargs)
        try:
            got, t_impl = call_implementation(lambda: self.call(subject, kwargs, params), case.seed, device,
                                              context.on_call)
        except Raised as raised:
            return Produced.failed_case(raised_row(base, raised))
        base = {**base, "path": got.path or base["path"], "stages": got.stages}
        rows = [r.to_record() for r in input_rows(base, inputs.changed(self.writes), time_impl_s=t_impl)]
        tensors, devices, strides, problems = {}, {}, {}, {}
        for name, out in got.tensors.items():
            why = output_problem(name, out, dtype=None, shape=None, device=None)
            why = why or (None if self.views else inputs.aliased_by(name, out))
            if why:
                problems[name] = why
                continue
            devices[name] = str(out.device)
            if not out.is_contiguous():  # the host copy is contiguous: the judge needs the strides returned
                strides[name] = tuple(out.stride())
            tensors[name] = out.detach().to("cpu", copy=True) if out.device.type != "meta" else out.detach()
        watch = guards.kept()
        return Produced(rows, tensors=tensors, devices=devices, strides=strides, problems=problems, stages=got.stages,
                        deviations=tuple(got.deviations), path=got.path, notes=tuple(got.notes), t_impl=t_impl,
                        returned=guards.Returned.of({n: got.tensors[n] for n in tensors}, tensors),
                        threads=watch.threads_left if watch is not None else [])

    def judge_produced(self, case: Case, produced: Produced, context: RowContext) -> list:
        """The rows of `case` from what `produce` sent: the reference computed here, on inputs
        built here, and every value judged here (`judge_produced_block` of one case)."""
        return self.judge_produced_block([case], [produced], context)[0]

    def prepare_inputs(self, cases: Sequence[Case], device: str = "cpu") -> "Prepared":
        """The inputs of a block's first part (`_in_parts`), its answer still to compute
        (`prepare_block`): an isolation worker's parent builds them once, for its reference and to
        hand to the worker (`Worker.run_block`)."""
        parts = self._in_parts(cases, self.params_of(cases[0].params), device)
        _, kwargs = next(parts)
        return Prepared(parts, kwargs, None, math.nan)

    def prepare_block(self, cases: Sequence[Case], device: str = "cpu",
                      inputs: "Prepared | None" = None) -> "Prepared":
        """What judging a block needs before any output of it exists: the inputs of its first part
        (`inputs`, from `prepare_inputs`, else built here) and the reference's answer to them. An
        isolation worker's parent computes it while the worker produces the block."""
        params = self.params_of(cases[0].params)
        prepared = inputs or self.prepare_inputs(cases, device)
        kwargs = prepared.kwargs
        prepared.answer, t_ref = timed(lambda: self._answer(kwargs, params), device)
        prepared.t_ref = t_ref / len(kwargs)
        return prepared

    def judge_produced_block(self, cases: Sequence[Case], produced: Sequence[Produced], context: RowContext,
                             prepared: "Prepared | None" = None) -> list[list]:
        """The rows of each of `cases` (one params, as `evaluate_block`'s) from what `produce` sent
        for it: the reference of the block and every verdict computed here (`prepared`: its first
        part's, from `prepare_block` on these cases)."""
        found = [[Row.from_record(r) for r in p.rows] for p in produced]
        if all(p.failed for p in produced):
            return found
        params, device = self.params_of(cases[0].params), context.device
        parts = (prepared or self.prepare_block(cases, device)).answers(lambda kw: self._answer(kw, params), device)
        start = 0
        for kwargs, answer, t_ref in parts:
            got = produced[start:start + len(kwargs)]
            at = [j for j, p in enumerate(got) if not p.failed]
            bases = []
            for case, p in zip(cases[start:start + len(kwargs)], got):
                base = context.base(case, self.identity(case, params))
                bases.append({**base, "path": p.path or base["path"], "stages": p.stages})

            def problem(j: int, name: str, out: Any, want: torch.Tensor, check: Check) -> str | None:
                return got[j].problems.get(name) or self._output_problem(check, out, want, got[j].devices.get(name),
                                                                         got[j].strides.get(name))

            verdicts = self._verdicts(at, bases, params, kwargs, answer,
                                      [{**p.tensors, **{name: None for name in p.problems}} for p in got],
                                      [p.deviations for p in got],
                                      [dict(time_ref_s=t_ref, time_impl_s=p.t_impl) for p in got], problem)
            for j in at:
                rows = found[start + j]
                for r in rows:
                    r.time_ref_s = t_ref
                rows += verdicts[j]
            start += len(kwargs)
            del kwargs, answer  # not held while the next part is built and answered
        return found


@dataclass
class Prepared:
    """A block's first part prepared for judging (`OpSpec.prepare_block`): its inputs, the
    reference's answer and its seconds per case, and the block's later parts still to build."""

    rest: Iterator[tuple[list[Case], list[dict]]]
    kwargs: list[dict]
    answer: "Answer | None"  # None once handed over (`answers`)
    t_ref: float

    def answers(self, answer: Callable[[list[dict]], "Answer"], device: str) -> Iterator[tuple[list[dict], "Answer", float]]:
        """(inputs, answer, reference seconds per case) of each part of the block, in order. A part
        is handed over, not kept: while the next is built and answered, neither its inputs nor
        its answer are held here (an isolated 4-part campaign on one H200 ran out of its GPU share
        holding them; the consumer drops its own)."""
        first, self.kwargs, self.answer = (self.kwargs, self.answer, self.t_ref), [], None
        yield first
        del first
        for part, kwargs in self.rest:
            found, t_ref = timed(lambda: answer(kwargs), device)
            yield kwargs, found, t_ref / len(part)
            del kwargs, found


@dataclass
class _Called:
    """A case of a block whose implementation returned: its outputs, their deviations and times,
    its input rows, and why an output shares memory it must not."""

    tensors: dict[str, Any] | None
    deviations: tuple[str, ...]
    times: dict
    rows: list
    shared: dict[str, str]
    threads: list = field(default_factory=list)       # left running by the call (threading.Thread)
    after: list[str] = field(default_factory=list)    # outputs written after the call returned

    @classmethod
    def none(cls) -> "_Called":
        return cls(None, (), {}, [], {})


@dataclass
class Answer:
    """The reference's answer for the cases of a block: each case's tensors by name and, where
    they were computed in one call (or there is one case), the same tensors with a leading case
    axis, views of what the call returned."""

    cases: list[dict[str, torch.Tensor]]
    stacked: dict[str, torch.Tensor]

    def names(self) -> dict[str, str]:
        return {name: name for name in self.cases[0]}

    def of(self, name: str | None, at: Sequence[int]) -> torch.Tensor | None:
        """Tensor `name` of the cases `at`, stacked (None where the reference has no `name`)."""
        if name is None or name not in self.cases[0]:
            return None
        if name in self.stacked:
            whole = self.stacked[name]
            return whole if list(at) == list(range(len(self.cases))) else whole[list(at)]
        return torch.stack([self.cases[i][name] for i in at])


def _nbytes(kwargs: Mapping[str, Any]) -> int:
    """Bytes of the storages the tensors of `kwargs` live in (each once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for name, value in kwargs.items() for _, t in tensors_in(value, name) if t.device.type != "meta"}
    return sum(storages.values())
