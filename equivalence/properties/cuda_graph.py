"""cuda_graph: a kernel captured in a CUDA graph on static buffers replays what it computes eagerly.

    replay     the target captured once (`torch.cuda.CUDAGraph`) on the case's problem, then
               replayed on the problems of each of `replay_seeds` (the same shapes, copied into
               the captured buffers): every output bit for bit the eager call's on that problem.
    reference  the same replays against the float64 reference, within the op's own bounds.

Serving runs the decode this way (vLLM's FlashMLA sparse builder: `UNIFORM_BATCH` graphs over
static buffers). A kernel that syncs with the host (`.item()`, a host-side check of the indices),
copies host memory into a new device tensor, reads sizes on the host or keeps state between calls
(a cache keyed by address) either refuses the capture (the case fails, reason "does not capture")
or replays something other than what it computes eagerly. What is captured is the implementation's
`graph` entry (`optimized.registry`): for the registered kernels the launch path, since their
input checks read the inputs on the host; those checks run first, in the eager call on every
problem. A user's kernel is captured as it is called. Each replay's outputs are copied out before
the next (the graph owns its buffers). CUDA only: elsewhere a usage error with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from hypothesis import strategies as st

from mla_verify.optimized import registry

from ..case import Case
from ..contract import ContractError, Snapshot, guarded, output_problem
from ..device import first_line
from ..draws import SEEDS, decode_params, prefill_params
from ..mismatch import Pair
from ..oracle import judge, measure, verdict
from ..policy import EXACT, property_bounds
from ..running import Raised, call_implementation, failure_row, judged_row, raised_row, timed
from ..schema import Ints, param
from ..spec import SPECS, register
from ..subject import Subject, UsageError
from .base import PropertySpec, Target
from .common import decode_knobs, decode_problem, prefill_knobs, prefill_problem

REPLAYS = 3  # drawn problems replayed per capture
NAMES = {"sparse_prefill": ("out", "lse", "max_logits"), "sparse_decode_fp8": ("out", "lse")}
WHY_CUDA = "captures CUDA graphs: it runs on a CUDA device only"


@dataclass(frozen=True)
class Replays:
    replay_seeds: tuple[int, ...] = param(Ints(0, 2**31 - 1, 16), kw_only=True)  # the problems replayed


class CaptureError(RuntimeError):
    """The implementation's call could not be captured in a CUDA graph."""


def _layout(t: Any) -> Any:
    return (t.dtype, tuple(t.shape), t.stride()) if isinstance(t, torch.Tensor) else t is None


def _same_layout(static: dict, problem: dict, seed: int) -> None:
    """Every replayed problem fits the captured buffers (ours to guarantee: shapes come from the params)."""
    for name, value in static.items():
        if _layout(value) != _layout(problem[name]):
            raise RuntimeError(f"the problem of replay seed {seed} does not fit the captured {name}")


def capture_and_replay(eager: Callable, graph_fn: Callable, problems: Sequence[dict]) -> tuple[list, list]:
    """(eager outputs, replayed outputs) of `problems[1:]`, `graph_fn` captured on `problems[0]`.

    `eager` (the checked call) runs on every problem first, the capture's too; `graph_fn` warms
    up on a side stream, as torch's capture recipe asks (compilation, library handles, lazily made
    state), then is captured. Before each replay the problem is copied into the captured inputs;
    after it the outputs are cloned and the inputs compared with what was copied in."""
    static = problems[0]
    eager(**static)
    eager_out = [tuple(eager(**kw)) for kw in problems[1:]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph_fn(**static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            captured = tuple(graph_fn(**static))
    except Exception as exc:  # the implementation's: what it did inside the capture is not capturable
        # Ending a broken capture raises again ("a previous error during capture"): name the first error.
        first = exc.__context__ if exc.__context__ is not None else exc
        raise CaptureError(f"does not capture in a CUDA graph: {first_line(first)} (a host sync, a copy from "
                           "host memory or a size read on the host inside the call)") from exc
    replayed = []
    for i, kw in enumerate(problems[1:], 1):
        for name, value in kw.items():
            if isinstance(value, torch.Tensor):
                static[name].copy_(value)
        saved = Snapshot(static)
        graph.replay()
        replayed.append(tuple(t.clone() for t in captured))  # own a copy: the next replay overwrites them
        if changed := saved.changed():
            raise ContractError(f"replay {i} wrote its input {changed[0][1]}")
    return eager_out, replayed


def _stacked(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(tensors)) if tensors[0].dim() else torch.stack(list(tensors))


def _target(op: str, inputs: Callable, knobs: Callable, draw: Callable) -> Target:
    # `check` is unused: the property's own `evaluate` captures, replays and judges.
    return Target(op, lambda p: [op], (op,), inputs, lambda *_: [], knobs,
                  lambda p: draw(p, replay_seeds=st.lists(SEEDS, min_size=REPLAYS, max_size=REPLAYS)))


@dataclass(frozen=True)
class GraphSpec(PropertySpec):
    def facts(self, device: str) -> list[str]:
        return [*super().facts(device), *([] if device == "cuda" else [f"skipped on {device}: {WHY_CUDA}"])]

    def subjects(self, device: str) -> dict[str, tuple[str, ...]]:
        """The graph kernels (registry `graph`) of the stages under test, on CUDA; none elsewhere."""
        if device != "cuda":
            return {}
        return {name: specs for name, specs in super().subjects(device).items()
                if all(i.graph is not None for t in self.targets for i in registry.implementations(t) if i.name == name)}

    def subject(self, specs: Sequence[str], device: str, deviations: Sequence[str] = ()) -> Subject:
        if device != "cuda":
            raise UsageError(f"{self.name} {WHY_CUDA}, not {device}")
        subject = super().subject(specs, device, deviations)
        for stage in self.targets:
            impl = subject.overrides.get(stage)
            if impl is not None and impl.graph is None:
                raise UsageError(f"--impl {', '.join(specs)}: {stage} {impl.name} is no graph kernel (it syncs with "
                                 f"the host by design); {self.name} runs {', '.join(self.subjects(device)) or 'none'}")
        return subject

    def evaluate(self, case: Case, subject: Subject, device: str = "cpu", *, run_id: str = "", source: str = "fuzz",
                 notes: set[str] | None = None, on_call: Callable[[], None] | None = None) -> list:
        """The replay and reference rows of `case` (a single failure row if the implementation
        raised, refused the capture or wrote an input)."""
        params = self.params_of(case.params)
        target = self.target(params)
        op = SPECS[target.name].spec
        stages = registry.resolve([target.name], device.split(":")[0], subject.overrides)
        impl = stages.chosen[target.name]
        if impl.graph is None:
            raise UsageError(f"{impl.name} is no graph kernel")
        base = dict(run_id=run_id, case_id=case.case_id, impl=subject.label, stages=stages.describe(), device=device,
                    seed=case.seed, source=source, **self.identity(case, params))
        seeds = (case.seed, *params.replay_seeds)
        problems = [target.inputs(params, s, device) for s in seeds]
        for s, kw in zip(seeds[1:], problems[1:]):
            _same_layout(problems[0], kw, s)
        refs, t_ref = timed(lambda: [op.reference(kw, params) for kw in problems[1:]], device)
        eager = guarded(stages).fn(target.name)
        try:
            (eager_out, replayed), t_impl = call_implementation(
                lambda: capture_and_replay(eager, impl.graph, problems), case.seed, device, on_call)
        except Raised as raised:  # the implementation's failure is the case's result, not ours
            return [raised_row(base, raised, time_ref_s=t_ref)]
        if notes is not None:
            notes.update(f"{stage}: {why}" for stage, why in stages.fallbacks.items())
        times = dict(time_ref_s=t_ref, time_impl_s=t_impl)
        got = {n: _stacked([r[i] for r in replayed]) for i, n in enumerate(NAMES[target.name][:len(replayed[0])])}
        want = {n: _stacked([r[i] for r in eager_out]) for i, n in enumerate(NAMES[target.name][:len(eager_out[0])])}
        ref = {k: _stacked([r[k] for r in refs]) for k, v in refs[0].items() if isinstance(v, torch.Tensor)}
        rows = []
        for name, t in got.items():
            kind, bounds, deviation = property_bounds(f"{self.short}.replay", EXACT, impl.deviations)
            rows.append(judged_row(base, f"replay.{name}", "exact",
                                   verdict(kind, measure(kind, t, want[name]), bounds, deviation,
                                           Pair(name, t, want[name])), **times))
        for check in op.checks:
            if check.tensor not in ref or check.tensor not in got:
                continue  # the op's optional tensor this implementation does not return
            out = got[check.tensor]
            problem = output_problem(check.tensor, out, dtype=check.dtype or ref[check.tensor].dtype,
                                     shape=ref[check.tensor].shape, device=str(ref[check.tensor].device))
            if problem:
                rows.append(failure_row(base, f"reference.{check.tensor}", "contract", problem, **times))
                continue
            v = judge(check.kind, out, ref[check.tensor], params.numerics(), impl.deviations,
                      ref.get(check.scale) if check.scale else None, check.bounds_in(ref), name=check.tensor)
            rows.append(judged_row(base, f"reference.{check.tensor}", check.row_kind or check.kind, v, **times))
        return rows


register(GraphSpec(
    short="cuda_graph",
    checks=("replay", "reference"),
    own_params=Replays,
    targets={
        "sparse_prefill": _target("sparse_prefill", prefill_problem, prefill_knobs, prefill_params),
        "sparse_decode_fp8": _target("sparse_decode_fp8", decode_problem, decode_knobs, decode_params),
    },
    tag="property: replays against the eager call and the reference",
    doc="a kernel captured in a CUDA graph on static buffers replays, on new inputs copied in, what it computes eagerly",
), priority=109)
