"""The first stage that differs: a failing pipeline case run again stage by stage, each stage's
output judged against the reference's stage on the very inputs it was given.

A pipeline (forward_mqa, each of its DCP ranks) calls its stages through one `Resolved` table;
while a `Recorder` is active, `recorded` wraps every stage of it, so the run keeps each call's
keyword arguments and result. Each call is then answered by the reference's function of that
stage (`ORACLES`) on the same arguments and judged by that stage's own checks: bit for bit for
the index, layout and workspace stages, the oracle's bounds for attention and the merge. The
first call that differs names the stage, with its failing row's line (`equivalence.judge.rows.line`).

A stage judged on its own inputs is right or wrong by itself: a kernel handed wrong indices by
the converter before it matches the reference handed the same. A second run feeds the reference's
output of each stage on to the next implementation stage instead of the implementation's (`feed`),
so a later stage is also seen on the inputs it should have had: a fault the first one's wrong
output hides (every entry it reads -1) shows there, and where nothing else differs, the first
stage is the only fault. The fed run hands the implementation reference values: it is a
diagnosis, never a verdict (the case's rows are judged before it).

In an isolation worker, the calls travel to the parent as data (`moved` to the host): the parent computes
every reference and every judgment (`judge_calls`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from mla_verify import reference
from mla_verify.optimized.registry import Resolved

from ..cases.numerics import Numerics
from ..errors import ContractError
from ..judge.localize import axes_for
from ..judge.rows import QUIET_METRICS, line
from ..judge.oracle import Verdict, judge
from ..judge.policy import EXACT, LSE, OUT
from ..judge.rows import FailureKind
from ..sandbox.call_guards import returned
from .indices import named_indices


@dataclass(frozen=True)
class Compared:
    tensor: str
    kind: str                  # policy kind: exact | out | lse
    scale: str | None = None   # the reference's tensor of per-row scales (an LSE's logit_l1)


def _attention(res) -> tuple[tuple, dict[str, torch.Tensor]]:
    return (res.out, res.lse), {"out": res.out, "lse": res.lse, "logit_l1": res.logit_l1}


def _merge(kw) -> tuple[tuple, dict[str, torch.Tensor]]:
    out, lse = reference.dcp_merge(kw["outs"], kw["lses"])
    return (out, lse), {"out": out, "lse": lse, "logit_l1": torch.zeros_like(lse)}


def _one(name: str, fn: Callable[..., Any]) -> Callable[[dict], tuple[Any, dict]]:
    def answer(kw):
        value = fn(**kw)
        return value, {name: _chunks(value) if name == "chunks" else value}
    return answer


def _named(fn: Callable[..., Any], names: tuple[str, ...]) -> Callable[[dict], tuple[Any, dict]]:
    """A stage returning a tuple of tensors, each by its name."""
    def answer(kw):
        value = fn(**kw)
        return value, dict(zip(names, value))
    return answer


def _chunks(value: Any) -> torch.Tensor:
    return torch.tensor([list(c) for c in value], dtype=torch.long).reshape(-1, 2)


def _indices(fn: Callable[..., Any]) -> Callable[[dict], tuple[Any, dict]]:
    def answer(kw):
        value = fn(**kw)
        return value, named_indices(value, bool(kw.get("return_valid_counts")))
    return answer


@dataclass(frozen=True)
class StageOracle:
    """A stage's reference on a call's keywords -> (its result as the contract returns it, its
    tensors by name with their scales), and what is compared."""

    answer: Callable[[dict], tuple[Any, dict[str, torch.Tensor]]]
    compared: tuple[Compared, ...]
    names: Callable[[dict], tuple[str, ...]]  # the result's names, as the call returned them
    named: Callable[[dict, Any], dict[str, Any]] | None = None  # the result by name, where not `returned`'s
    required: int | None = None  # of `names`, the ones every implementation returns (None: all)

    def got(self, kwargs: dict, result: Any) -> dict[str, Any]:
        return self.named(kwargs, result) if self.named else returned(result, self.names(kwargs), self.required)


_ATTENTION = (Compared("out", OUT), Compared("lse", LSE, "logit_l1"))


def _pair(kw: dict) -> tuple[str, ...]:
    return ("out", "lse")


ORACLES: dict[str, StageOracle] = {
    "concat_mla_q": StageOracle(_one("q", reference.concat_mla_q), (Compared("q", EXACT),), lambda kw: ("q",)),
    "convert_index": StageOracle(
        _indices(reference.convert_index), (Compared("indices", EXACT), Compared("valid_counts", EXACT)),
        lambda kw: ("indices", "valid_counts") if kw.get("return_valid_counts") else ("indices",),
        lambda kw, result: named_indices(result, bool(kw.get("return_valid_counts")))),
    "dcp_convert_index": StageOracle(_one("indices", reference.dcp_convert_index), (Compared("indices", EXACT),),
                                     lambda kw: ("indices",)),
    "split_prefill_chunks": StageOracle(_one("chunks", reference.split_prefill_chunks), (Compared("chunks", EXACT),),
                                        lambda kw: ("chunks",)),
    "reshape_query_for_spec_decode": StageOracle(_one("q", reference.reshape_query_for_spec_decode),
                                                 (Compared("q", EXACT),), lambda kw: ("q",)),
    "reshape_attn_output_for_spec_decode": StageOracle(_one("out", reference.reshape_attn_output_for_spec_decode),
                                                       (Compared("out", EXACT),), lambda kw: ("out",)),
    "gather_upconvert_fp8": StageOracle(_one("workspace", reference.gather_upconvert_fp8),
                                        (Compared("workspace", EXACT),), lambda kw: ("workspace",)),
    "gather_upconvert_nvfp4": StageOracle(_one("workspace", reference.gather_upconvert_nvfp4),
                                          (Compared("workspace", EXACT),), lambda kw: ("workspace",)),
    "sparse_prefill": StageOracle(lambda kw: _attention(reference.sparse_prefill(**kw)), _ATTENTION,
                                  lambda kw: ("out", "lse", "max_logits"), required=2),
    "sparse_decode_fp8": StageOracle(lambda kw: _attention(reference.sparse_decode(**kw)), _ATTENTION, _pair),
    "sparse_decode_nvfp4": StageOracle(lambda kw: _attention(reference.sparse_decode(**kw)), _ATTENTION, _pair),
    "dcp_merge": StageOracle(_merge, _ATTENTION, _pair),
    "window_indices": StageOracle(
        _named(reference.window_indices, ("indices", "lengths")),
        (Compared("indices", EXACT), Compared("lengths", EXACT)), lambda kw: ("indices", "lengths")),
    "sparse_decode_v4": StageOracle(lambda kw: _attention(reference.sparse_decode_v4(**kw)), _ATTENTION, _pair),
}
# Whose contract names a stage's dimensions (`localize.dims_of`): the nvfp4 decode shares fp8's.
CONTRACT_OF = {"sparse_decode_nvfp4": "sparse_decode_fp8"}


@dataclass
class Call:
    """One stage call of a pipeline run: what it was given and what it returned."""

    stage: str
    impl: str
    deviations: tuple[str, ...]
    rank: int | None
    kwargs: dict[str, Any]
    result: Any


@dataclass
class Recorder:
    """The stage calls of the pipeline runs made while it is active (`recording`)."""

    feed: bool = False
    calls: list[Call] = field(default_factory=list)
    rank: int | None = None

    def wrap(self, stage: str, impl) -> Callable:
        def call(**kwargs: Any) -> Any:
            if "dcp_rank" in kwargs:  # a DCP run's ranks run one after another, each starting here
                self.rank = kwargs["dcp_rank"]
            result = impl.fn(**kwargs)
            rank = None if stage == "dcp_merge" else self.rank
            self.calls.append(Call(stage, impl.name, tuple(impl.deviations), rank, kwargs, result))
            if self.feed and stage in ORACLES:
                return _like(ORACLES[stage].answer(kwargs)[0], result)
            return result

        return call


_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("stage_recorder", default=None)


@contextlib.contextmanager
def recording(feed: bool = False) -> Iterator[Recorder]:
    """Record the stage calls of the pipeline runs made inside (`recorded`)."""
    recorder = Recorder(feed)
    token = _RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        _RECORDER.reset(token)


def recorded(stages: Resolved) -> Resolved:
    """`stages` with every call recorded while a `recording` is active (as they are otherwise)."""
    recorder = _RECORDER.get()
    if recorder is None:
        return stages
    return Resolved({s: dataclasses.replace(impl, fn=recorder.wrap(s, impl)) for s, impl in stages.chosen.items()},
                    stages.fallbacks)


def _like(ref: Any, got: Any) -> Any:
    """The reference's stage result in the form and dtypes the implementation returned its own."""
    if isinstance(ref, torch.Tensor) and isinstance(got, torch.Tensor):
        return ref.to(got.device, got.dtype)
    if isinstance(ref, tuple) and isinstance(got, (tuple, list)):  # (out, lse), (indices, counts)
        return tuple(_like(r, g) for r, g in zip(ref, got))
    return ref


def fields_of(call: Call) -> dict[str, Any]:
    """A call as plain data (its fields by name, the values themselves), as `equivalence.sandbox.wire` sends it."""
    return {f.name: getattr(call, f.name) for f in dataclasses.fields(call)}


def moved(calls: Sequence[Call], device: str = "cpu") -> list[Call]:
    """The calls with every tensor copied to `device`: to the host, the data an isolation worker
    sends its judge; from it, to where the judge computes. A tensor several calls were handed (the
    cache) is copied, and sent, once."""
    copies: dict[int, torch.Tensor] = {}

    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if id(x) not in copies:
                copies[id(x)] = x.detach().to(device, copy=True)
            return copies[id(x)]
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(one(v) for v in x))
        if isinstance(x, (tuple, list)):
            return type(x)(one(v) for v in x)
        return x

    return [dataclasses.replace(c, kwargs={k: one(v) for k, v in c.kwargs.items()}, result=one(c.result))
            for c in calls]


@dataclass(frozen=True)
class Differs:
    """A stage call whose output differs from the reference's stage on the same inputs."""

    call: Call
    verdict: Verdict
    tensor: str

    def where(self) -> str:
        rank = f" (rank {self.call.rank})" if self.call.rank is not None else ""
        return f"stage {self.call.stage}{rank}"

    def text(self) -> str:
        v = self.verdict
        return line(self.tensor, v.gate_metric, v.value, v.bound, v.reason)


def judge_call(call: Call, numerics: Numerics) -> Differs | None:
    """The first compared tensor of `call` that differs from the reference's stage on the same
    keywords, or None (None too for a stage with no oracle here)."""
    oracle = ORACLES.get(call.stage)
    if oracle is None:
        return None
    try:
        _, want = oracle.answer(call.kwargs)
    except (ValueError, IndexError, RuntimeError):
        return None  # inputs outside what the reference's stage takes: a fault of an earlier stage
    try:
        got = oracle.got(call.kwargs, call.result)
    except ContractError as exc:
        return Differs(call, Verdict(None, False, FailureKind.CONTRACT, 1.0, 0.0, 0.0, "", str(exc)), "*")
    contract = CONTRACT_OF.get(call.stage, call.stage)
    names = [c.tensor for c in oracle.compared]
    judged = numerics if call.stage == "dcp_merge" else numerics.replace(dcp_size=1)
    for c in oracle.compared:
        if c.tensor not in want or c.tensor not in got:
            continue
        impl = _chunks(got[c.tensor]) if c.tensor == "chunks" and not isinstance(got[c.tensor], torch.Tensor) \
            else got[c.tensor]
        if not isinstance(impl, torch.Tensor):
            continue
        v = judge(c.kind, impl, want[c.tensor], judged, call.deviations, scale=want.get(c.scale), name=c.tensor,
                  axes=axes_for(contract, c.tensor, names, call.kwargs))
        if not v.passed:
            return Differs(call, v, c.tensor)
    return None


def judge_calls(calls: Sequence[Call], numerics: Numerics) -> list[Differs]:
    """Every call of `calls` that differs, in call order."""
    return [d for c in calls if (d := judge_call(c, numerics)) is not None]


def first_difference(plain: Sequence[Call], fed: Sequence[Call], numerics: Numerics) -> tuple[str, str]:
    """(the first stage whose output differs from the reference's (the plain run's), the line that
    names it and what the run fed the reference's outputs shows of the others); ("", "") where no
    call was recorded, and no stage but a line where none differs."""
    found = judge_calls(plain, numerics)
    if not found:
        return "", ("every stage's output matches the reference's stage on its own inputs: what differs is how the "
                    "stages were put together, or a run that does not repeat") if plain else ""
    first = found[0]
    ranks = sorted({d.call.rank for d in found if d.call.stage == first.call.stage and d.call.rank is not None})
    also = f"; ranks {', '.join(map(str, ranks))} differ there" if len(ranks) > 1 else ""
    text = (f"{first.where()} is the first whose output differs from the reference's on the same inputs "
            f"({first.call.impl}): {first.text()}{also}")
    others = [d for d in judge_calls(fed, numerics) if d.call.stage != first.call.stage]
    if others:
        named = ", ".join(dict.fromkeys(d.where() for d in others))
        return first.call.stage, text + f"; fed the reference's stage outputs, {named} " \
            f"differ{'s' if len(others) == 1 else ''} too: {others[0].text()}"
    if fed:
        return first.call.stage, text + "; fed the reference's stage outputs, every other stage matches"
    return first.call.stage, text


def failing(rows: Sequence[Any]) -> bool:
    """Whether rows hold a value that failed (not a raise, a crash, a broken contract)."""
    return any(not r.passed and r.gate_metric not in QUIET_METRICS for r in rows)


def told(rows: Sequence[Any], stage: str, text: str) -> None:
    """Append `text` to the reason of each failing row of a value, and name the first `stage` that
    differs there (`Row.differing_stage`)."""
    if not text:
        return
    for r in rows:
        if not r.passed and r.gate_metric not in QUIET_METRICS:
            r.reason = "; ".join(filter(None, (r.reason, text)))
            r.differing_stage = stage


def traced(run: Callable[[], Any]) -> tuple[list[Call], list[Call]]:
    """The stage calls of `run()` made plain and made fed (`recording`); a run that raises keeps
    the calls it made."""
    runs = []
    for feed in (False, True):
        with recording(feed) as recorder:
            with contextlib.suppress(Exception):
                run()
        runs.append(recorder.calls)
    return runs[0], runs[1]

