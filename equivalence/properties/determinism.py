"""determinism: the same inputs give the same bits, run after run.

    rerun   the target twice on one problem, into fresh (poisoned) outputs: every tensor it
            returns compared bit for bit. FlashMLA's prefill and decode were measured bitwise
            deterministic on the H200; ours use no atomics and fixed reduction orders.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from mla_verify.equivalence.batch import make_batch
from mla_verify.equivalence.ops import get_op
from mla_verify.equivalence.policy import LSE, OUT

from . import Compared, PropertySpec, Target, register_property
from .common import (
    PIPELINE_STAGES,
    decode_knobs,
    decode_problem,
    forward,
    forward_knobs,
    forward_stages,
    prefill_knobs,
    prefill_problem,
)

NAMES = ("out", "lse", "max_logits")


def _target(name: str, stages: Callable[[Mapping], list[str]], under_test: tuple[str, ...],
            inputs: Callable[[Mapping, int, str], dict], run: Callable, knobs: Callable[[Mapping], dict]) -> Target:
    """A determinism target: `run(stages, inputs)` returns the tensors (out, lse[, max_logits])."""

    def check(kw: dict, p: Mapping, resolved) -> list:
        first, second = run(resolved, kw), run(resolved, kw)
        return [Compared("rerun", tensor, OUT if tensor == "out" else LSE, b, a)
                for tensor, a, b in zip(NAMES, first, second)]

    return Target(name, stages, under_test, inputs, check, knobs)


def _stage(name: str) -> Callable[[object, dict], tuple[torch.Tensor, ...]]:
    return lambda stages, kw: tuple(stages.fn(name)(**kw))


register_property(PropertySpec(
    name="determinism",
    checks=("rerun",),
    targets={
        "sparse_prefill": _target("sparse_prefill", lambda p: ["sparse_prefill"], ("sparse_prefill",),
                                  prefill_problem, _stage("sparse_prefill"), prefill_knobs),
        "sparse_decode_fp8": _target("sparse_decode_fp8", lambda p: ["sparse_decode_fp8"], ("sparse_decode_fp8",),
                                     decode_problem, _stage("sparse_decode_fp8"), decode_knobs),
        "forward_mqa": _target("forward_mqa", forward_stages, PIPELINE_STAGES,
                               lambda p, seed, device: {"batch": make_batch(p, seed, device)},
                               lambda stages, kw: forward(stages, kw["batch"]), forward_knobs),
        "dcp_merge": _target("dcp_merge", lambda p: ["dcp_merge"], ("dcp_merge",), get_op("dcp_merge").inputs,
                             _stage("dcp_merge"), get_op("dcp_merge").knobs),
    },
    doc="the same inputs give bitwise the same outputs run to run",
))
