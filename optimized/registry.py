"""Stage name -> implementations: the one table the pipeline and the harness read.

A stage is a public-contract function (`sparse_prefill`, `convert_index`, ...). Each stage has
one or more implementations, each registered with a priority: the lower, the more preferred
(`FLASH_MLA` < `TRITON` < `EAGER`), and two implementations of one stage may not share one, so
the preference order is the priorities' and never the order modules happen to be imported in.
Each implementation also says which devices it runs on, whether it can run here (flash_mla needs
its wheel and an SM90/SM100 GPU), which documented deviations from the exact contract it has
(their bounds live in `equivalence.judge.policy`), and what a CUDA graph captures of it (`graph`).

The default on a device is the first implementation that runs there natively: one that runs only
under an interpreter (our Triton kernels on CPU, `TRITON_INTERPRET=1`, 10-1000x slower than the
eager torch-fp32 ones) is chosen by name only, or when nothing else runs.

`forward_mqa` looks every stage up here, so replacing one stage with a user's kernel is a
dictionary update (`resolve(..., overrides={"sparse_prefill": fn})`), not a fork of the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import torch

# Priorities, most preferred first: the real flash_mla kernels, our Triton kernels, plain eager
# PyTorch (or Python). A stage with one implementation may leave it at the default, EAGER; a
# second one left there too is refused as a tie, not ranked by when it was imported.
FLASH_MLA, TRITON, EAGER = 0, 1, 2


@dataclass(frozen=True)
class Implementation:
    stage: str
    name: str
    fn: Callable
    devices: frozenset[str]
    # Returns None when the implementation can run here, else the reason it cannot.
    unavailable: Callable[[], str | None] = field(default=lambda: None, compare=False)
    deviations: tuple[str, ...] = ()
    doc: str = ""
    interpreted_on: frozenset[str] = frozenset()  # devices where it runs only under an interpreter
    priority: int = EAGER  # lower is preferred; unique within a stage
    # What serving captures in a CUDA graph: the kernel without its host-side input checks (they
    # read the inputs on the host, so they run before capture); None: not a graph kernel (the
    # eager torch-fp32 ones index with boolean masks, a host sync each).
    graph: Callable | None = field(default=None, compare=False)

    def why_not(self, device: str) -> str | None:
        if device not in self.devices:
            return f"runs on {'/'.join(sorted(self.devices))}, not {device}"
        if device == "cuda" and not torch.cuda.is_available():
            return "no CUDA GPU is visible"
        return self.unavailable()


# Stage -> its implementations in preference order (ascending priority).
_REGISTRY: dict[str, list[Implementation]] = {}


def register(
    stage: str,
    name: str,
    *,
    priority: int = EAGER,
    devices: Iterable[str] = ("cpu", "cuda"),
    unavailable: Callable[[], str | None] | None = None,
    deviations: Iterable[str] = (),
    doc: str = "",
    interpreted_on: Iterable[str] = (),
    graph: Callable | None = None,
) -> Callable[[Callable], Callable]:
    """Decorator: add `fn` as implementation `name` of `stage`, ranked by `priority` (lower is
    preferred); a name or a priority the stage already has is refused."""

    def add(fn: Callable) -> Callable:
        impl = Implementation(
            stage=stage,
            name=name,
            fn=fn,
            devices=frozenset(devices),
            unavailable=unavailable or (lambda: None),
            deviations=tuple(deviations),
            doc=doc or (fn.__doc__ or "").strip().split("\n")[0],
            interpreted_on=frozenset(interpreted_on),
            priority=priority,
            graph=graph,
        )
        impls = _REGISTRY.setdefault(stage, [])
        for other in impls:
            if other.name == name:
                raise ValueError(f"stage {stage!r} already has an implementation named {name!r}")
            if other.priority == priority:
                raise ValueError(f"stage {stage!r}: {name!r} and {other.name!r} both have priority {priority}")
        impls.append(impl)
        impls.sort(key=lambda i: i.priority)
        return fn

    return add


def stages() -> list[str]:
    return sorted(_REGISTRY)


def implementations(stage: str) -> list[Implementation]:
    if stage not in _REGISTRY:
        raise KeyError(f"unknown stage {stage!r}; known: {', '.join(stages())}")
    return list(_REGISTRY[stage])


def interpreted(names: Iterable[str], device: str) -> bool:
    """Whether an implementation called one of `names` (an --impl's NAME or STAGE=NAME) runs only
    under an interpreter on `device`: a campaign of it is held to the interpreter's budget."""
    wanted = {n.split("=")[-1] for n in names}
    return any(impl.name in wanted and device in impl.interpreted_on
               for impls in _REGISTRY.values() for impl in impls)


def select(stage: str, device: str, name: str | None = None) -> Implementation:
    """The implementation called `name`, or else the default of `stage` on `device`: the preferred
    one that runs there natively, an interpreted one only when nothing else runs."""
    reasons, interpreted = [], []
    for impl in implementations(stage):
        if name is not None and impl.name != name:
            continue
        why = impl.why_not(device)
        if why is None and name is None and device in impl.interpreted_on:
            interpreted.append(impl)
        elif why is None:
            return impl
        else:
            reasons.append(f"{impl.name}: {why}")
    if interpreted:
        return interpreted[0]
    if name is not None and not reasons:
        known = ", ".join(i.name for i in implementations(stage))
        raise KeyError(f"stage {stage!r} has no implementation {name!r}; known: {known}")
    raise RuntimeError(f"no implementation of {stage!r} runs on {device}: " + "; ".join(reasons))


@dataclass(frozen=True)
class Resolved:
    """The implementation chosen for each stage, plus why preferred ones were passed over."""

    chosen: Mapping[str, Implementation]
    fallbacks: Mapping[str, str]  # stage -> "flash_mla: <reason>" for each preference that cannot run here

    def fn(self, stage: str) -> Callable:
        return self.chosen[stage].fn

    def pairs(self) -> tuple[tuple[str, str], ...]:
        """(stage, implementation name) of each stage, sorted by stage: what a row records."""
        return tuple((s, self.chosen[s].name) for s in sorted(self.chosen))


def resolve(
    needed: Iterable[str],
    device: str,
    overrides: Mapping[str, Implementation] | None = None,
) -> Resolved:
    """Pick an implementation for every stage in `needed`; `overrides` win over the registry."""
    overrides = dict(overrides or {})
    chosen: dict[str, Implementation] = {}
    fallbacks: dict[str, str] = {}
    for stage in needed:
        if stage in overrides:
            chosen[stage] = overrides[stage]
            continue
        impl = select(stage, device)
        first = implementations(stage)[0]
        if impl.name != first.name and first.why_not(device) is not None:
            fallbacks[stage] = f"{first.name}: {first.why_not(device)}"
        chosen[stage] = impl
    return Resolved(chosen, fallbacks)
