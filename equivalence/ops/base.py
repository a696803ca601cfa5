"""An op of the public contract as a Spec (`equivalence.spec`): how to build its inputs from a
Case, what the reference says, how to call an implementation, and which tensors to compare.

`OpSpec` is an op with one stage in the registry (`optimized.registry`): a subject is one
implementation of that stage. The pipelines (`ops.forward`, `ops.dcp`) extend it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from hypothesis import strategies as st

from mla_verify.optimized import registry

from .. import cost
from ..case import Case
from ..draws import SEEDS
from ..contract import Snapshot, output_problem
from ..contracts import arguments as contract_arguments
from ..oracle import judge
from ..produced import Produced
from ..profiles import Profile
from ..rows import Row
from ..running import Raised, call_implementation, failure_row, input_rows, judged_row, raised_row, timed
from ..schema import Params
from ..subject import Subject, UsageError, implementation



@dataclass(frozen=True)
class Check:
    tensor: str            # name in the reference's and the implementation's outputs
    kind: str              # policy kind: exact | out | lse
    scale: str | None = None  # reference tensor of per-row scales: an LSE's logit_l1, an output's value_max
    optional: bool = False    # compared only when the implementation returns it (max_logits)
    single_rank: bool = False  # one DCP rank's pre-combine partial: held to the bounds without DCP
    dtype: torch.dtype | None = None  # the contract's dtype (None: the reference's, for exact tensors)
    contiguous: bool = False   # the contract asks for a dense tensor (a later kernel reads it so)
    row_kind: str | None = None  # its rows' kind (equivalence.rows) where not the policy kind's own
    # reference tensor of derived per-element bounds (equivalence.bounds), "NAME@DEVIATION" for a
    # deviation's own: held to elem_bound_ratio <= 1
    bound: str | None = None

    def bounds_in(self, ref: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The reference's bound tensors of this check by deviation ("" none), or None."""
        if self.bound is None:
            return None
        return {name.partition("@")[2]: t for name, t in ref.items() if name.partition("@")[0] == self.bound}


@dataclass
class ImplOutput:
    tensors: dict[str, torch.Tensor]
    stages: str = ""                 # "stage=impl,..." when a pipeline ran
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
    writes: tuple[str, ...] = ()      # arguments written in place (their bytes are the op's checks)
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
        return st.builds(lambda p, seed: Case(self.name, p, seed), self.draw(profile), SEEDS)

    def examples(self, profile: Profile) -> int:
        return profile.examples

    def interpreted_s(self, params: Params) -> float:
        """The Triton interpreter's seconds for a case (equivalence.cost)."""
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

    def _base(self, case: Case, params: Params, label: str, device: str, run_id: str, source: str) -> dict:
        return dict(run_id=run_id, case_id=case.case_id, impl=label, stages="", device=device, seed=case.seed,
                    source=source, **self.identity(case, params))

    def evaluate(self, case: Case, subject: Subject, device: str = "cpu", *, run_id: str = "", source: str = "fuzz",
                 notes: set[str] | None = None, on_call: Callable[[], None] | None = None) -> list:
        """Every checked tensor of `case` as a Row (a single failure row if the implementation
        raised), judged in this process. `notes` collects what the implementation side reported
        (a stage that fell back to a portable implementation); `on_call` runs once inputs and
        reference are ready, just before the implementation."""
        params = self.params_of(case.params)
        base = self._base(case, params, subject.label, device, run_id, source)
        kwargs = self.inputs(params, case.seed, device)
        ref, t_ref = timed(lambda: self.reference(kwargs, params), device)
        inputs = Snapshot(kwargs)
        answer = Snapshot(ref, "the reference's answer", apart_from=inputs)
        try:
            got, t_impl = call_implementation(lambda: self.call(subject, kwargs, params), case.seed, device, on_call)
        except Raised as raised:  # the implementation's failure is the case's result, not ours
            return [raised_row(base, raised, time_ref_s=t_ref)]
        if notes is not None:
            notes.update(got.notes)
        base = {**base, "path": got.path or base["path"], "stages": got.stages}
        times = dict(time_ref_s=t_ref, time_impl_s=t_impl)
        touched = answer.changed()
        if touched:  # every verdict below would compare against what the implementation wrote
            return [failure_row(base, "*", "contract", touched[0][1], **times)]

        def problem(name: str, out: Any, want: torch.Tensor, check: Check) -> str | None:
            return (self._output_problem(check, out, want)
                    or (None if self.views else inputs.aliased_by(name, out)) or answer.aliased_by(name, out))

        return input_rows(base, inputs, self.writes, **times) + self._verdicts(
            base, params, kwargs, ref, got.tensors, got.deviations, times, problem)

    def _output_problem(self, check: Check, out: Any, want: torch.Tensor, returned_on: str | None = None,
                        returned_strides: Sequence[int] | None = None) -> str | None:
        return output_problem(check.tensor, out, dtype=check.dtype or want.dtype, shape=want.shape,
                              # where the exact answer lives (host-side ops answer on the host);
                              # rank answers come back through the host
                              device=None if self.own_processes else str(want.device),
                              contiguous=check.contiguous, returned_on=returned_on, returned_strides=returned_strides)

    def _verdicts(self, base: dict, params: Params, kwargs: dict, ref: Mapping[str, torch.Tensor],
                  tensors: Mapping[str, Any], deviations: Sequence[str], times: dict, problem: Callable) -> list:
        """A row per check: missing, a broken contract (`problem(name, out, want, check)`), or the
        oracle's verdict against the reference."""
        rows = []
        for check in self.checks:
            if check.tensor not in ref or (check.optional and check.tensor not in tensors):
                continue  # not asked for by this case, or not produced by this implementation
            kind = check.row_kind or check.kind
            if check.tensor not in tensors:
                rows.append(failure_row(base, check.tensor, "missing", f"the implementation returned no {check.tensor!r}",
                                        kind=kind, **times))
                continue
            out, want = tensors[check.tensor], ref[check.tensor]
            why = problem(check.tensor, out, want, check)
            if why:
                rows.append(failure_row(base, check.tensor, "contract", why, kind=kind, **times))
                continue
            scale = ref.get(check.scale) if check.scale else None
            numerics = params.numerics()
            v = judge(check.kind, out, want, numerics.replace(dcp_size=1) if check.single_rank else numerics,
                      deviations, scale, check.bounds_in(ref), name=check.tensor)
            if v.metrics.nan_count and self.explain_nan is not None:
                v.reason = "; ".join(filter(None, (v.reason, self.explain_nan(kwargs, check.tensor, out, want))))
            rows.append(judged_row(base, check.tensor, kind, v, **times))
        return rows

    def produce(self, case: Case, subject: Subject, device: str = "cpu", *, run_id: str = "", source: str = "fuzz",
                on_call: Callable[[], None] | None = None) -> Produced:
        """The implementation's side of `case`, for a judge in another process (an isolation
        worker's parent): its outputs on the host with the device each came back on, and the
        rows and reasons this side alone can give (it raised, wrote an input, returned something
        that is not a plain dense tensor, or an input). No reference is computed here: the
        implementation never sees it."""
        params = self.params_of(case.params)
        base = self._base(case, params, subject.label, device, run_id, source)
        kwargs = self.inputs(params, case.seed, device)
        inputs = Snapshot(kwargs)
        try:
            got, t_impl = call_implementation(lambda: self.call(subject, kwargs, params), case.seed, device, on_call)
        except Raised as raised:
            return Produced([raised_row(base, raised).to_record()], failed=True)
        base = {**base, "path": got.path or base["path"], "stages": got.stages}
        rows = [r.to_record() for r in input_rows(base, inputs, self.writes, time_impl_s=t_impl)]
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
        return Produced(rows, tensors=tensors, devices=devices, strides=strides, problems=problems, stages=got.stages,
                        deviations=tuple(got.deviations), path=got.path, notes=tuple(got.notes), t_impl=t_impl)

    def judge_produced(self, case: Case, produced: Produced, label: str, device: str = "cpu", *, run_id: str = "",
                       source: str = "fuzz") -> list:
        """The rows of `case` from what `produce` sent: the reference computed here, on inputs
        built here, and every value judged here."""
        rows = [Row.from_record(r) for r in produced.rows]
        if produced.failed:
            return rows
        params = self.params_of(case.params)
        base = self._base(case, params, label, device, run_id, source)
        base = {**base, "path": produced.path or base["path"], "stages": produced.stages}
        kwargs = self.inputs(params, case.seed, device)
        ref, t_ref = timed(lambda: self.reference(kwargs, params), device)
        times = dict(time_ref_s=t_ref, time_impl_s=produced.t_impl)
        for r in rows:
            r.time_ref_s = t_ref

        def problem(name: str, out: Any, want: torch.Tensor, check: Check) -> str | None:
            return produced.problems.get(name) or self._output_problem(check, out, want, produced.devices.get(name),
                                                                       produced.strides.get(name))

        tensors = {**produced.tensors, **{name: None for name in produced.problems}}
        return rows + self._verdicts(base, params, kwargs, ref, tensors, produced.deviations, times, problem)
