"""A pipeline op as a Spec: forward_mqa and its multi-process DCP form call many stages.

Its subject is the project's pipeline with any stage replaced (`STAGE=NAME`,
`STAGE=MODULE:CALLABLE`, or a registered `NAME` in every stage that has one), or a user's whole
function (`MODULE:CALLABLE`, with the op's keyword arguments). It may have paths (`--path`) the
fuzzer can be held to, and world sizes it runs over.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from hypothesis import strategies as st

from mla_verify.optimized import registry

from ..cases.builders import stamped
from ..cases.case import Case
from ..cases.draws import SEEDS
from ..cases.profiles import Profile
from ..errors import UsageError
from ..judge.rows import RowContext
from ..sandbox.calls import Raised, call_implementation
from ..sandbox.produced import Produced
from ..subject import Subject, pipeline_subject
from . import stages
from .base import OpSpec

# On a GPU a pipeline is checked twice: with the preferred stages (flash_mla attention) and with
# our Triton attention kernels in their place.
VARIANTS = {"pipeline": (), "pipeline[triton attention]": ("sparse_prefill=triton", "sparse_decode_fp8=triton")}
# A failing case is run again stage by stage (`equivalence.ops.stages`) in process, except for a re-run
# (it only asks whether the failure repeats); an isolation worker records the stages only of the
# cases a run reports (a shrink step's, whose last is the minimized case, a replay's, the first
# failure's first re-run, `trace`: a campaign that does not shrink still names the stage, and the few
# kept and pinned cases a run replays first): it cannot know which of its cases fail, and recording
# every case would run each three times.
UNTRACED = frozenset({"rerun", "bench"})
TRACED_IN_WORKER = frozenset({"shrink", "replay", "trace", "kept", "corpus"})
# The worker's traced runs count against the case's timeout (its parent waits for one answer): a
# case whose call took longer than this is not traced there (the runs take about twice as long).
TRACE_CALL_S = 20.0


@dataclass(frozen=True)
class PipelineSpec(OpSpec):
    paths: tuple[str, ...] = ()            # what --path may hold the draw to
    own_campaigns: tuple[str, ...] = ()    # paths the gate fuzzes apart: the unrestricted draw never takes them
    draw_path: Callable[[Profile, str], st.SearchStrategy[dict]] | None = None
    draw_ranks: Callable[[Profile, int], st.SearchStrategy[dict]] | None = None
    traced: Callable[[Any], bool] = lambda params: True  # whether its stages are recorded (`equivalence.ops.stages`)
    # Its subjects on a GPU: label -> --impl strings, each attention stage also run with our Triton kernel.
    variants: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: VARIANTS)
    path_stages: Callable[[str], frozenset[str]] | None = None  # the stages a path's batches may call

    def paths_calling(self, stages: Iterable[str]) -> tuple[str, ...]:
        """The paths whose batches may call one of `stages` (a replaced stage is exercised there only)."""
        wanted = set(stages)
        return tuple(p for p in self.paths if self.path_stages is not None and wanted & self.path_stages(p))

    def draws_for(self, stages: Iterable[str]) -> tuple[str | None, ...]:
        """What a campaign that replaces `stages` and names no path draws: the unrestricted draw
        where it may call one of them, else the paths fuzzed apart (HiSparse) that do; the
        unrestricted draw where none does (the stages stay never called: no verdict)."""
        calling = self.paths_calling(stages)
        if not calling or any(p not in self.own_campaigns for p in calling):
            return (None,)
        return calling

    def strategy(self, profile: Profile, path: str | None = None, world_size: int | None = None) -> st.SearchStrategy[Case]:
        if path is not None:
            if path not in self.paths:
                raise KeyError(f"{self.name} has no path {path!r}; paths: {', '.join(self.paths) or 'none'}")
            params = self.draw_path(profile, path)
        elif world_size is not None:
            if world_size not in self.ranks:
                raise KeyError(f"{self.name} runs world sizes {', '.join(map(str, self.ranks)) or 'none'}, not {world_size}")
            params = self.draw_ranks(profile, world_size)
        else:
            params = self.draw(profile)
        return st.builds(lambda p, seed: Case(self.name, stamped(self.params, p), seed), params, SEEDS)

    def subject(self, specs: Sequence[str], device: str, deviations: Sequence[str] = ()) -> Subject:
        return pipeline_subject(self.name, specs, device, deviations)

    def subjects(self, device: str) -> dict[str, tuple[str, ...]]:
        """The pipeline with its preferred stages, and on a GPU where the preferred attention is
        not ours, again with our Triton attention (`variants`)."""
        attention = {spec.split("=")[0] for specs in self.variants.values() for spec in specs}
        if device == "cuda" and any(registry.select(stage, device).name != "triton" for stage in attention):
            return dict(self.variants)
        return {"pipeline": ()}

    def campaigns(self, subject: Subject) -> list[str | None]:
        return [None] if subject.fn is not None else [None, *self.own_campaigns]

    def path_for(self, path: str | None, subject: Subject) -> str | None:
        if path is not None and path not in self.paths:
            raise UsageError(f"--path applies to --op {self.name} with one of {', '.join(self.paths)}"
                             if self.paths else f"--path: {self.name} has no paths")
        return path

    def evaluate_block(self, cases: Sequence[Case], subject: Subject, context: RowContext) -> list[list]:
        """`OpSpec.evaluate_block`, each failing case then told the first stage whose output
        differs (`equivalence.ops.stages`)."""
        found = super().evaluate_block(cases, subject, context)
        if context.source in UNTRACED or not self._traces(subject, cases[0]):
            return found
        for case, rows in zip(cases, found):
            if rows is not None and stages.failing(rows):
                self._tell(case, rows, self._traced(case, subject, context.device))
        return found

    def _traces(self, subject: Subject, case: Case) -> bool:
        """Whether the case's stages are recorded: the project's pipeline, one process, a path whose
        stages have oracles (`traced`)."""
        return not self.own_processes and subject.fn is None and self.traced(self.params_of(case.params))

    def _tell(self, case: Case, rows: list, calls: tuple[list, list]) -> None:
        stage, text = stages.first_difference(*calls, self.params_of(case.params).numerics())
        stages.told(rows, stage or self.name, text)  # no stage differs on its own inputs: their composition does

    def _traced(self, case: Case, subject: Subject, device: str) -> tuple[list, list]:
        """The case's stage calls, plain and fed, on inputs built again from its seed."""
        params = self.params_of(case.params)

        def run() -> None:
            kwargs = self.inputs(params, case.seed, device)
            try:
                call_implementation(lambda: self.call(subject, kwargs, params), case.seed, device)
            except Raised:
                pass  # the calls before the raise are kept
        return stages.traced(run)

    def produce(self, case: Case, subject: Subject, context: RowContext, inputs: dict[str, Any] | None = None) -> Produced:
        """`OpSpec.produce`, with the stage calls of the cases a run reports (TRACED_IN_WORKER),
        on the host, for the judge to judge."""
        produced = super().produce(case, subject, context, inputs)
        if (context.source not in TRACED_IN_WORKER or produced.failed or not self._traces(subject, case)
                or not produced.t_impl <= TRACE_CALL_S):
            return produced
        plain, fed = self._traced(case, subject, context.device)
        host = [stages.fields_of(c) for c in stages.moved(plain + fed)]  # the cache both runs were handed goes once
        return replace(produced, stage_calls=(host[:len(plain)], host[len(plain):]))

    def judge_produced_block(self, cases: Sequence[Case], produced: Sequence[Produced], context: RowContext,
                             prepared: Any = None) -> list[list]:
        """`OpSpec.judge_produced_block`, each failing case told the first stage that differs
        from the stage calls the worker sent."""
        found = super().judge_produced_block(cases, produced, context, prepared)
        for case, p, rows in zip(cases, produced, found):
            if p.stage_calls[0] and stages.failing(rows):
                plain, fed = ([stages.Call(**c) for c in run] for run in p.stage_calls)
                calls = stages.moved(plain + fed, context.device)  # judged where the reference runs
                self._tell(case, rows, (calls[:len(plain)], calls[len(plain):]))
        return found
