"""One OpSpec per public-contract op and per forward_mqa path: how to build its inputs from a
Case, what the reference says, how to call an implementation, and which tensors to compare."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch


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
    stage: str | None                 # registry stage of the project's implementation (None: pipeline)
    arguments: tuple[str, ...]        # keyword arguments every implementation must accept
    inputs: Callable[[Mapping, int, str], dict[str, Any]]          # (params, seed, device) -> kwargs
    reference: Callable[[dict[str, Any], Mapping], dict[str, torch.Tensor]]
    call: Callable[[Any, dict[str, Any], Mapping], ImplOutput]   # (Subject, kwargs, params)
    checks: tuple[Check, ...]
    knobs: Callable[[Mapping], dict[str, Any]] = field(default=lambda p: {})
    path: Callable[[Mapping], str] | None = None
    doc: str = ""
    # Runs its implementation in processes of its own, each isolated already: never inside an
    # isolation worker (a daemonic worker process cannot start children).
    own_processes: bool = False
    writes: tuple[str, ...] = ()      # arguments written in place (their bytes are the op's checks)
    views: bool = False               # the result may be a view of an input (the reshapes)

    def path_of(self, params: Mapping) -> str:
        return self.path(params) if self.path else self.name


OPS: dict[str, OpSpec] = {}


def register_op(spec: OpSpec) -> OpSpec:
    if spec.name in OPS:
        raise ValueError(f"op {spec.name!r} registered twice")
    OPS[spec.name] = spec
    return spec


def get_op(name: str) -> OpSpec:
    if name not in OPS:
        raise KeyError(f"unknown op {name!r}; known: {', '.join(sorted(OPS))}")
    return OPS[name]


def _load() -> None:
    from . import attention, dcp, formats, forward, indices, layout, workspace  # noqa: F401


_load()
