"""Metamorphic and determinism properties: checks that need no reference.

A property poses one problem two ways that agree in exact arithmetic (a top-k set and the LSE
merge of its parts, a decode batch and its requests one at a time, a run and its rerun, ...) and
holds an implementation's two answers to each other. At production shapes the float64 reference
is the bottleneck, and some bugs (batch dependence, nondeterminism, a wrong LSE that a single
call never shows) appear only as inconsistency.

A property case is a Case with op "property:NAME" and params {"target": TARGET, ...}: the target
is what runs (a stage such as "sparse_decode_fp8", or "forward_mqa", the pipeline), the rest its
base problem (the op's own params, see equivalence.ops) and the property's knobs. Its rows have
op "property", path NAME and tensor "CHECK.TENSOR" (e.g. "wider_k.out"); each check's bound is
`equivalence.policy.PROPERTY_RULES["NAME.CHECK"]`: exact where the kernels promise identical bits,
a rounding bound elsewhere, and a declared deviation's bound where a kernel documents why not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from mla_verify.optimized import registry

PREFIX = "property:"


@dataclass(frozen=True)
class Compared:
    """One tensor a check holds to another: `got` (the transformed problem's answer) against
    `base` (the plain problem's), measured as policy kind `kind`."""

    check: str
    tensor: str                      # out | lse | indices
    kind: str                        # exact | out | lse (the tensor's nature; PROPERTY_RULES may compare it exactly)
    got: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor | None = None  # lse: the logit scale of each row


Inputs = dict[str, Any]


@dataclass(frozen=True)
class Target:
    name: str
    stages: Callable[[Mapping], list[str]]       # registry stages a case of these params calls
    under_test: tuple[str, ...]                  # stages whose implementations the target exercises
    inputs: Callable[[Mapping, int, str], Inputs]  # (params, seed, device) -> the base problem
    check: Callable[[Inputs, Mapping, registry.Resolved], list[Compared]]
    knobs: Callable[[Mapping], dict[str, Any]]


@dataclass(frozen=True)
class PropertySpec:
    name: str
    checks: tuple[str, ...]
    targets: Mapping[str, Target]
    doc: str

    @property
    def op(self) -> str:
        return PREFIX + self.name

    def path_of(self, params: Mapping) -> str:
        return self.name

    def knobs(self, params: Mapping) -> dict[str, Any]:
        return self.targets[params["target"]].knobs(params)

    def covered(self, stages: Iterable[str]) -> list[str]:
        """Targets that exercise one of `stages` (an --impl's overrides); none given: every target."""
        stages = set(stages)
        return [t.name for t in self.targets.values() if not stages or stages & set(t.under_test)]

    def implementations(self, device: str) -> list[str]:
        """Names of the implementations of the stages under test that run on `device`."""
        names: dict[str, None] = {}
        for target in self.targets.values():
            for stage in target.under_test:
                names.update((i.name, None) for i in registry.implementations(stage) if i.why_not(device) is None)
        return list(names)


PROPERTIES: dict[str, PropertySpec] = {}


def register_property(spec: PropertySpec) -> PropertySpec:
    if spec.name in PROPERTIES:
        raise ValueError(f"property {spec.name!r} registered twice")
    PROPERTIES[spec.name] = spec
    return spec


def is_property(op: str) -> bool:
    return op.startswith(PREFIX)


def get_property(op: str) -> PropertySpec:
    """The property of op "property:NAME"."""
    name = op.removeprefix(PREFIX)
    if not is_property(op) or name not in PROPERTIES:
        known = ", ".join(PREFIX + n for n in PROPERTIES)
        raise KeyError(f"unknown property {op!r}; known: {known}")
    return PROPERTIES[name]


def _load() -> None:
    # In the order `mla-verify list` shows them.
    from . import split, decode_prefill, padding, batch_invariance, spec_decode, dcp_one, determinism, hisparse_plain  # noqa: F401


_load()
