"""Pieces shared by the op specs: calling a single-function subject, knobs, seeded generators."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..cases.schema import Params
from .base import ImplOutput


def generator(seed: int, device: str) -> torch.Generator:
    """Every tensor of a case comes from this generator, on the device the case runs on: the
    tensors are a deterministic function of (case, device type), built where they are used."""
    return torch.Generator(device=device).manual_seed(seed)


def host_values(values: list, device: str) -> torch.Tensor:
    """A few numbers from the host as a tensor on `device`, without waiting: a copy from pageable
    memory waits for everything queued on the device, so a case's inputs would wait for the
    previous case's; from pinned memory the copy is queued like any other op."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, device=device)
    return torch.tensor(values, pin_memory=True).to(device, non_blocking=True)


def rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand(shape, generator=gen, device=gen.device)


def randint(gen: torch.Generator, lo: int, hi: int, *shape: int) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=gen, device=gen.device)


def single(unpack: Callable[[Any], dict[str, torch.Tensor]]) -> Callable:
    """A `call` for ops with one implementation function: call it with the contract's keywords."""

    def call(subject, kwargs: dict, params: Params) -> ImplOutput:
        return ImplOutput(unpack(subject.fn(**kwargs)), deviations=subject.deviations)

    return call


KNOBS = ("topk", "heads", "block_size", "dcp_size", "cache_dtype", "scale_rule", "value_regime", "sm_scale")


def knobs(params: Params, **derived: Any) -> dict[str, Any]:
    """The report's knob columns (equivalence.judge.rows): the params' fields of those names, plus
    `derived` values; a column the op has no field for stays empty."""
    return {**{k: getattr(params, k) for k in KNOBS if hasattr(params, k)}, **derived}
