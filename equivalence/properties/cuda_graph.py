"""cuda_graph: a kernel captured in a CUDA graph on static buffers replays what it computes eagerly.

    replay     the target captured once (`torch.cuda.CUDAGraph`) on the case's problem, then
               replayed on the problems of each of `replay_seeds` (the same shapes, copied into
               the captured buffers): every output bit for bit the eager call's on that problem.
    unpadded   with `capture` 2 or 4 (the op targets), the batch is captured at that multiple of the
               problems' own and each replay copies in the real rows followed by serving's padding
               (rows whose indices are all -1): the replay's real rows bit for bit the eager call on
               the real rows alone (a kernel declaring split_kv, whose split depends on the batch, to
               its bounds: on the H100 flash_mla and our Triton decode differ there by one bf16
               ulp, and are bitwise equal to the eager call on the padded problem, as `replay` checks)
    padding    the replay's padding rows hold the empty-row contract: out 0, lse +inf (max_logits -inf)
    reference  the same replays (their real rows) against the float64 reference, within the op's own bounds.

Targets: the two attention ops, and forward_mqa on decode batches (uniform spec decodes on the
separate path, or the mixed path), the batch's metadata (req_id) built before capture as vLLM's
builder keeps it in a persistent buffer, with the index conversion and the decode stage captured.

Serving runs the decode this way (vLLM's FlashMLA sparse builder: `UNIFORM_BATCH` graphs over
static buffers). A kernel that syncs with the host (`.item()`, a host-side check of the indices),
copies host memory into a new device tensor, reads sizes on the host or keeps state between calls
(a cache keyed by address) either refuses the capture (the case fails, reason "does not capture")
or replays something other than what it computes eagerly. What is captured of a stage under test
is its implementation's `graph` entry (`optimized.registry`): for the registered kernels the
launch path, since their input checks read the inputs on the host; those checks run first, in the
eager call on every problem. A user's kernel is captured as it is called, and so is a stage not
under test that has no graph entry (the reshapes). Each replay's outputs are copied out before the
next (the graph owns its buffers). CUDA only: elsewhere a usage error with that reason.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from hypothesis import strategies as st

from mla_verify.equivalence.cases.batch import make_batch
from mla_verify.optimized import registry
from mla_verify.optimized.metadata import req_id_per_token

from ..cases.case import Case
from ..cases.draws import SEEDS, decode_params, forward_params, prefill_params
from ..cases.schema import Ints, OneOf, param
from ..errors import ContractError
from ..errors import UsageError
from ..judge import mismatch
from ..judge.oracle import judge, measure, verdict
from ..judge.policy import EXACT, LSE, OUT, property_bounds
from ..judge.rows import FailureKind, Row, RowContext
from ..sandbox.call_guards import Snapshot, guarded, output_problem, returned
from ..sandbox.calls import Raised, call_implementation, failure_row, judged_row, raised_row, timed
from ..sandbox.device import device_type, first_line
from ..sandbox.produced import Produced
from ..spec import SPECS, op_of, register
from ..subject import Subject
from ..sandbox.produced import Compared
from .base import PropertySpec, Target, _host
from .common import (
    decode_knobs,
    decode_problem,
    decode_scale,
    forward,
    forward_knobs,
    forward_stages,
    prefill_knobs,
    prefill_problem,
    prefill_scale,
)

REPLAYS = 3  # drawn problems replayed per capture
WHY_CUDA = "captures CUDA graphs: it runs on a CUDA device only"


CAPTURES = (1, 2, 4)  # the captured batch, in multiples of the real one (the op targets)
# What a padding row (every index -1) must hold: the empty-row contract of both attention ops.
EMPTY_ROW = {"out": 0.0, "lse": math.inf, "max_logits": -math.inf}
ROW_INPUTS = ("q", "indices", "topk_length")  # an op problem's tensors of a row per query row (dim 0)


@dataclass(frozen=True)
class Replays:
    replay_seeds: tuple[int, ...] = param(Ints(0, 2**31 - 1, 16), kw_only=True)  # the problems replayed
    # The batch captured, in multiples of the problems' own (1: the same): the rows past the real
    # ones are serving's padding, their indices all -1 (the op targets only).
    capture: int = param(OneOf(*CAPTURES), default=1, kw_only=True)


def _padded(kw: dict, times: int) -> dict:
    """An op problem grown to `times` its rows along dim 0, as serving pads a batch up to a captured
    size: each padding row's query is a real row's (whatever the buffer held), its indices all -1.
    (Grown tensors are contiguous: a padded problem keeps no drawn layout.)"""
    def grown(name: str, t: torch.Tensor) -> torch.Tensor:
        pad = t.repeat(times - 1, *[1] * (t.dim() - 1))
        return torch.cat([t, pad.fill_(-1) if name == "indices" else pad])

    return {name: grown(name, t) if name in ROW_INPUTS and t is not None else t for name, t in kw.items()}


def _logit_scale(kw: dict) -> torch.Tensor:
    """The logit scale of an op problem's LSE, laid out as the op lays out its LSE."""
    if "kv" in kw:
        return prefill_scale(kw)
    batch, s_q, heads = kw["q"].shape[:3]
    return decode_scale(kw).view(batch, s_q, heads).transpose(1, 2)


def _padding_compared(real: list[dict], replayed: list[dict], alone: list[dict], rows: int | None,
                      move) -> list[Compared]:
    """A padded capture's own checks: the real rows of each replay against the eager call on the
    real rows alone ("unpadded": bitwise, a split-KV kernel's batch-dependent split aside) and its
    padding rows against the empty-row contract ("padding": out 0, lse +inf, max_logits -inf,
    exactly; a -0.0 is 0)."""
    if rows is None:
        return []
    scale = _stacked([_logit_scale(kw) for kw in real[1:]])
    found = []
    for n in replayed[0]:
        got = _stacked([r[n][:rows] for r in replayed])
        if n in alone[0]:
            kind, unit = (OUT, None) if n == "out" else (LSE, move(scale))
            found.append(Compared("unpadded", n, kind, move(got), move(_stacked([a[n] for a in alone])), unit))
        pad = _stacked([r[n][rows:] for r in replayed]) + 0.0  # -0.0 + 0.0 is 0.0
        found.append(Compared("padding", n, EXACT, move(pad), move(torch.full_like(pad, EMPTY_ROW[n]))))
    return found


class CaptureError(RuntimeError):
    """The implementation's call could not be captured in a CUDA graph."""


def _layout(t: Any) -> Any:
    return (t.dtype, tuple(t.shape), t.stride()) if isinstance(t, torch.Tensor) else t is None


def _same_layout(static: dict, problem: dict, seed: int) -> None:
    """Every replayed problem fits the captured buffers (ours to guarantee: shapes come from the params)."""
    for name, value in static.items():
        if _layout(value) != _layout(problem[name]):
            raise RuntimeError(f"the problem of replay seed {seed} does not fit the captured {name}")


def _outputs(result: Any, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """An implementation's result by name (2 required: out, lse), every one a tensor."""
    found = returned(result, names, 2)
    for name, t in found.items():
        if not isinstance(t, torch.Tensor):
            raise ContractError(f"{name}: a {type(t).__name__}, the contract says a torch.Tensor")
    return found


def capture_and_replay(eager: Callable[[dict], Any], graph_fn: Callable[[dict], Any], problems: Sequence[dict],
                       buffers: Sequence[dict[str, torch.Tensor]], names: tuple[str, ...]) -> tuple[list[dict], list[dict]]:
    """(eager outputs, replayed outputs) of `problems[1:]` by name (`names`: the op's results),
    `graph_fn` captured on `problems[0]`; `buffers[i]`: the tensors of problem i a replay copies in.

    `eager` (the checked call) runs on every problem first, the capture's too; `graph_fn` warms
    up on a side stream, as torch's capture recipe asks (compilation, library handles, lazily made
    state), then is captured. Before each replay the problem is copied into the captured inputs;
    after it the outputs are cloned and the inputs compared with what was copied in."""
    static, inputs = problems[0], buffers[0]
    eager(static)
    eager_out = [_outputs(eager(kw), names) for kw in problems[1:]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph_fn(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            result = graph_fn(static)
    except Exception as exc:  # the implementation's: what it did inside the capture is not capturable
        # Ending a broken capture raises again ("a previous error during capture"): name the first error.
        first = exc.__context__ if exc.__context__ is not None else exc
        raise CaptureError(f"does not capture in a CUDA graph: {first_line(first)} (a host sync, a copy from "
                           "host memory or a size read on the host inside the call)") from exc
    captured = _outputs(result, names)
    replayed = []
    for i, tensors in enumerate(buffers[1:], 1):
        for name, t in tensors.items():
            inputs[name].copy_(t)
        saved = Snapshot(inputs)
        graph.replay()
        replayed.append({n: t.clone() for n, t in captured.items()})  # own a copy: the next replay overwrites them
        if changed := saved.changed():
            raise ContractError(f"replay {i} wrote its input {changed[0][1]}")
    return eager_out, replayed


def _stacked(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(tensors)) if tensors[0].dim() else torch.stack(list(tensors))


@dataclass(frozen=True)
class Form:
    """How a target is called, captured and judged: `op` gives the problem's reference and checks."""

    op: str
    names: tuple[str, ...]                                   # what a call returns
    buffers: Callable[[dict], dict[str, torch.Tensor]]       # problem -> the tensors a replay copies in
    eager: Callable[[registry.Resolved, dict], Any]          # the checked call
    graph: Callable[[registry.Resolved, dict], Any]          # the captured call (graph stages)


def _op_form(op: str, names: tuple[str, ...]) -> Form:
    def call(stages: registry.Resolved, kw: dict) -> Any:
        return stages.fn(op)(**kw)

    return Form(op, names, lambda kw: {k: v for k, v in kw.items() if isinstance(v, torch.Tensor)}, call, call)


def _batch_buffers(kw: dict) -> dict[str, torch.Tensor]:
    b = kw["batch"]
    q = dict(zip(("ql_nope", "q_pe"), b.q)) if isinstance(b.q, tuple) else {"q": b.q}
    return {**q, "kv_cache": b.kv_cache, "block_table": b.block_table, "topk_indices": b.topk_indices}


FORMS = {
    "sparse_prefill": _op_form("sparse_prefill", ("out", "lse", "max_logits")),
    "sparse_decode_fp8": _op_form("sparse_decode_fp8", ("out", "lse")),
    "forward_mqa": Form("forward_mqa", ("out", "lse"), _batch_buffers,
                        lambda stages, kw: forward(stages, kw["batch"]),
                        lambda stages, kw: forward(stages, kw["batch"], req_id=kw["req_id"])),
}


def _forward_inputs(p, seed: int, device: str) -> dict:
    batch = make_batch(p, seed, device)
    return {"batch": batch, "req_id": req_id_per_token(batch.query_start_loc, batch.query_start_loc[-1], device)}


def _graph_stages(stages: registry.Resolved) -> registry.Resolved:
    """Every stage as a graph captures it: its graph entry, or its call where it has none."""
    return registry.Resolved({s: dataclasses.replace(i, fn=i.graph or i.fn) for s, i in stages.chosen.items()},
                             stages.fallbacks)


def _unused(*_) -> list:
    return []  # a Target's `check`: this property's own `evaluate` captures, replays and judges


def _with_replays(draw: st.SearchStrategy[dict], captures: tuple[int, ...] = (1,)) -> st.SearchStrategy[dict]:
    return st.builds(lambda d, seeds, capture: {**d, "replay_seeds": seeds, **({"capture": capture} if capture > 1 else {})},
                     draw, st.lists(SEEDS, min_size=REPLAYS, max_size=REPLAYS), st.sampled_from(captures))


def _decode_batches(p) -> st.SearchStrategy[dict]:
    """Uniform decode batches of 2-4 tokens each: on the separate path, or the mixed one."""
    return st.one_of(forward_params(p, "fp8_separate", decodes_only=True), forward_params(p, "fp8_mixed", decodes_only=True))


@dataclass(frozen=True)
class GraphSpec(PropertySpec):
    def facts(self, device: str) -> list[str]:
        return [*super().facts(device), *([] if device == "cuda" else [f"skipped on {device}: {WHY_CUDA}"])]

    def _no_graph(self, impls) -> list[str]:
        """The implementations among `impls` of a stage under test that have no graph entry."""
        under_test = {stage for t in self.targets.values() for stage in t.under_test}
        return [f"{i.stage} {i.name}" for i in impls if i.stage in under_test and i.graph is None]

    def subjects(self, device: str) -> dict[str, tuple[str, ...]]:
        """The implementation names whose every stage under test is a graph kernel, on CUDA; none elsewhere."""
        if device != "cuda":
            return {}
        return {name: specs for name, specs in super().subjects(device).items()
                if not self._no_graph(i for stage in registry.stages() for i in registry.implementations(stage)
                                      if i.name == name and i.why_not(device) is None)}

    def subject(self, specs: Sequence[str], device: str, deviations: Sequence[str] = ()) -> Subject:
        if device != "cuda":
            raise UsageError(f"{self.name} {WHY_CUDA}, not {device}")
        subject = super().subject(specs, device, deviations)
        if bad := self._no_graph(subject.overrides.values()):
            raise UsageError(f"--impl {', '.join(specs)}: {bad[0]} is no graph kernel (it syncs with the host by "
                             f"design); {self.name} runs {', '.join(self.subjects(device)) or 'none'}")
        return subject

    def produce(self, case: Case, subject: Subject, context: RowContext, inputs: None = None,
                on_host: bool = True) -> Produced:
        """The implementation's side of `case`: its eager answers and graph replays on every
        problem (on the host for a judge in another process, `on_host`), or the single row of
        its failure (it raised, refused the capture or wrote an input)."""
        params, device = self.params_of(case.params), context.device
        target, form = self.target(params), FORMS[params.target]
        stages = registry.resolve(target.stages(params), device_type(device), subject.overrides)
        if bad := self._no_graph(stages.chosen.values()):
            raise UsageError(f"{bad[0]} is no graph kernel")
        deviations = tuple(sorted({d for impl in stages.chosen.values() for d in impl.deviations}))
        base = context.base(case, self.identity(case, params), stages.pairs())
        if params.capture > 1 and params.target not in ("sparse_prefill", "sparse_decode_fp8"):
            raise UsageError(f"capture={params.capture}: a padded capture applies to the op targets, not {params.target}")
        seeds = (case.seed, *params.replay_seeds)
        real = [target.inputs(params, s, device) for s in seeds]
        problems = [_padded(kw, params.capture) for kw in real] if params.capture > 1 else real
        buffers = [form.buffers(kw) for kw in problems]
        for s, kw in zip(seeds[1:], buffers[1:]):
            _same_layout(buffers[0], kw, s)
        checked, captured = guarded(stages, op_of), _graph_stages(stages)

        def replays() -> tuple[list[dict], list[dict], list[dict]]:
            eager_out, replayed = capture_and_replay(lambda kw: form.eager(checked, kw), lambda kw: form.graph(captured, kw),
                                                     problems, buffers, form.names)
            alone = [] if problems is real else [_outputs(form.eager(checked, kw), form.names) for kw in real[1:]]
            return eager_out, replayed, alone

        try:
            (eager_out, replayed, alone), t_impl = call_implementation(replays, case.seed, device, context.on_call)
        except Raised as raised:  # the implementation's failure is the case's result, not ours
            return Produced.failed_case(raised_row(base, raised))
        move = _host if on_host else (lambda t: t)
        rows = None if problems is real else len(real[0]["q"])  # a padded capture's real rows come first
        # the replayed outputs' real rows by name (what the reference judges), and every replayed row
        # held to the eager call's answer on the same (padded) problem, bitwise
        tensors = {n: move(_stacked([r[n][:rows] for r in replayed])) for n in replayed[0]}
        compared = [Compared("replay", n, EXACT, move(_stacked([r[n] for r in replayed])),
                             move(_stacked([r[n] for r in eager_out]))) for n in tensors if n in eager_out[0]]
        compared += _padding_compared(real, replayed, alone, rows, move)
        return Produced([], tensors=tensors, stages=stages.pairs(), deviations=deviations, t_impl=t_impl,
                        notes=tuple(f"{stage}: {why}" for stage, why in stages.fallbacks.items()), compared=compared)

    def judge_produced(self, case: Case, produced: Produced, context: RowContext) -> list:
        """The replay rows (each replay against the eager call, bitwise) and the reference rows
        (each replay against the exact answer of its problem, built again here from its seed)."""
        rows = [Row.from_record(r) for r in produced.rows]
        if produced.failed:
            return rows
        params, device = self.params_of(case.params), context.device
        target, form = self.target(params), FORMS[params.target]
        op = SPECS[form.op].spec
        base = context.base(case, self.identity(case, params), produced.stages)
        problems = [target.inputs(params, s, device) for s in params.replay_seeds]
        refs, t_ref = timed(lambda: [op.reference(kw, params) for kw in problems], device)
        times = dict(time_ref_s=t_ref, time_impl_s=produced.t_impl)
        got = {name: t.to(device) for name, t in produced.tensors.items()}
        ref = {k: _stacked([r[k] for r in refs]) for k, v in refs[0].items() if isinstance(v, torch.Tensor)}
        for c in produced.compared:  # each replay against the eager call (a padded capture's: `_padding_compared`)
            t, want = c.got.to(device), c.base.to(device)
            kind, bounds, deviation = property_bounds(f"{self.short}.{c.check}", c.kind, produced.deviations)
            v = verdict(kind, measure(kind, t, want), bounds, deviation,
                        lambda: mismatch.Pair(f"{c.check}.{c.tensor}", t, want))
            rows.append(judged_row(base, f"{c.check}.{c.tensor}", "exact" if kind == EXACT else c.tensor, v,
                                   check=c.check, **times))
        for check in op.checks:
            if check.tensor not in ref or check.tensor not in got:
                continue  # the op's optional tensor this implementation does not return
            out = got[check.tensor]
            problem = output_problem(check.tensor, out, dtype=check.dtype or ref[check.tensor].dtype,
                                     shape=ref[check.tensor].shape, device=str(ref[check.tensor].device))
            if problem:
                rows.append(failure_row(base, f"reference.{check.tensor}", FailureKind.CONTRACT, problem, **times))
                continue
            v = judge(check.kind, out, ref[check.tensor], params.numerics(), produced.deviations,
                      ref.get(check.scale) if check.scale else None, check.bounds_in(ref), name=check.tensor)
            rows.append(judged_row(base, f"reference.{check.tensor}", check.row_kind or check.kind, v, **times))
        return rows

register(GraphSpec(
    short="cuda_graph",
    checks=("replay", "unpadded", "padding", "reference"),
    own_params=Replays,
    targets={
        "sparse_prefill": Target("sparse_prefill", lambda p: ["sparse_prefill"], ("sparse_prefill",), prefill_problem,
                                 _unused, prefill_knobs, lambda p: _with_replays(prefill_params(p), CAPTURES)),
        "sparse_decode_fp8": Target("sparse_decode_fp8", lambda p: ["sparse_decode_fp8"], ("sparse_decode_fp8",),
                                    decode_problem, _unused, decode_knobs,
                                    lambda p: _with_replays(decode_params(p), CAPTURES)),
        "forward_mqa": Target("forward_mqa", forward_stages, ("convert_index", "sparse_decode_fp8"), _forward_inputs,
                              _unused, forward_knobs, lambda p: _with_replays(_decode_batches(p))),
    },
    tag="property: replays against the eager call and the reference",
    doc="a kernel captured in a CUDA graph on static buffers replays, on new inputs copied in, what it computes eagerly",
), priority=109)
