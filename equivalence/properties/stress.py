"""stress: a deterministic kernel rerun many times, interleaved with another problem and with
other work loading the same GPU, gives the same bits every time (FlashMLA's kernelkit stress).

    rerun   the target on the case's problem and on a second one (the next seed), RUNS times
            each in an order drawn from the case's seed, a burst of matmuls and copies queued on a
            side stream before each call: every output of a problem bit for bit its first. A
            kernel whose result depends on scheduling (a race, an atomic order, a split plan read
            from a device property that varies under load, state kept between calls) differs.

CUDA only (on a CPU nothing else shares the device and a call runs alone): elsewhere a usage error
with that reason, and `list` says so. Written for the GPU lane; it has not run on a GPU yet.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..cases.draws import decode_params, prefill_params
from ..errors import UsageError
from ..judge.policy import EXACT
from ..spec import register
from ..subject import Subject
from ..sandbox.produced import Compared
from .base import PropertySpec, Target
from .common import decode_knobs, decode_problem, prefill_knobs, prefill_problem

RUNS = 8           # calls per problem
LOAD = 2048        # side of the matmuls loading the GPU between calls
WHY_CUDA = "loads a CUDA device with other work between calls: it runs on a CUDA device only"
NAMES = ("out", "lse", "max_logits")


def interleaving(seed: int, runs: int = RUNS) -> list[int]:
    """The order of `runs` calls on each of two problems (0, 1), shuffled by `seed`."""
    order = [0] * runs + [1] * runs
    random.Random(seed).shuffle(order)
    return order


def _load(device: torch.device, side: torch.cuda.Stream, rng: random.Random) -> None:
    """A burst of work on `side`, not waited for: 1-3 matmuls and a device copy."""
    with torch.cuda.stream(side):
        a = torch.randn((LOAD, LOAD), device=device)
        for _ in range(rng.randint(1, 3)):
            a = a @ a.T / LOAD
        a.clone()


def problem_seed(kw: dict) -> int:
    """A seed read from the problem's indices: the same for a case's replay, no host state."""
    return int(kw["indices"].long().sum()) & 0x7FFFFFFF


def _target(name: str, problem: Callable, knobs: Callable, draw: Callable) -> Target:
    def check(kw: dict, p, stages) -> list[Compared]:
        fn, device, seed = stages.fn(name), kw["q"].device, problem_seed(kw)
        problems = [kw, problem(p, seed, str(device))]
        rng, side = random.Random(seed), torch.cuda.Stream(device=device)
        firsts: list = [None, None]
        found = []
        for which in interleaving(seed):
            _load(device, side, rng)
            got = tuple(t.clone() for t in tuple(fn(**problems[which]))[:3])
            if firsts[which] is None:
                firsts[which] = got
                continue
            found += [Compared("rerun", f"{NAMES[i]}@{which}", EXACT, a, b)
                      for i, (a, b) in enumerate(zip(got, firsts[which]))]
        torch.cuda.current_stream(device).wait_stream(side)
        return found

    return Target(name, lambda p: [name], (name,), problem, check, knobs, draw, runs=lambda p: 2 * RUNS)


@dataclass(frozen=True)
class CudaOnlySpec(PropertySpec):
    """A property that needs a CUDA device: none of its subjects elsewhere, a usage error naming why."""

    why: str = WHY_CUDA

    def facts(self, device: str) -> list[str]:
        return [*super().facts(device), *([] if device == "cuda" else [f"skipped on {device}: {self.why}"])]

    def subjects(self, device: str) -> dict[str, tuple[str, ...]]:
        return super().subjects(device) if device == "cuda" else {}

    def subject(self, specs: Sequence[str], device: str, deviations: Sequence[str] = ()) -> Subject:
        if device != "cuda":
            raise UsageError(f"{self.name} {self.why}, not {device}")
        return super().subject(specs, device, deviations)


register(CudaOnlySpec(
    short="stress",
    checks=("rerun",),
    targets={
        "sparse_prefill": _target("sparse_prefill", prefill_problem, prefill_knobs, prefill_params),
        "sparse_decode_fp8": _target("sparse_decode_fp8", decode_problem, decode_knobs, decode_params),
    },
    doc="a deterministic kernel rerun interleaved with another problem under GPU load gives the same bits (CUDA only)",
), priority=110)
