"""determinism: the same inputs give the same bits, run after run.

    rerun   the target twice on one problem, into fresh (poisoned) outputs: every tensor it
            returns compared bit for bit. FlashMLA's prefill and decode were measured bitwise
            deterministic on the H200; ours use no atomics and fixed reduction orders.
"""

from __future__ import annotations

from typing import Callable

import torch

from mla_verify.equivalence.cases.batch import make_batch
from mla_verify.equivalence.judge.policy import LSE, OUT

from ..cases.draws import decode_params, forward_params, merge_params, prefill_params
from ..cases.schema import Params
from ..ops.dcp import DCP_MERGE
from ..spec import register
from ..sandbox.produced import Compared
from .base import PropertySpec, Target
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


def _target(name: str, stages: Callable[[Params], list[str]], under_test: tuple[str, ...],
            inputs: Callable[[Params, int, str], dict], run: Callable, knobs: Callable[[Params], dict],
            draw: Callable) -> Target:
    """A determinism target: `run(stages, inputs)` returns the tensors (out, lse[, max_logits])."""

    def check(kw: dict, p: Params, resolved) -> list:
        first, second = run(resolved, kw), run(resolved, kw)
        return [Compared("rerun", tensor, OUT if tensor == "out" else LSE, b, a)
                for tensor, a, b in zip(NAMES, first, second)]

    return Target(name, stages, under_test, inputs, check, knobs, draw)


def _stage(name: str) -> Callable[[object, dict], tuple[torch.Tensor, ...]]:
    return lambda stages, kw: tuple(stages.fn(name)(**kw))


register(PropertySpec(
    short="determinism",
    checks=("rerun",),
    targets={
        "sparse_prefill": _target("sparse_prefill", lambda p: ["sparse_prefill"], ("sparse_prefill",),
                                  prefill_problem, _stage("sparse_prefill"), prefill_knobs, prefill_params),
        "sparse_decode_fp8": _target("sparse_decode_fp8", lambda p: ["sparse_decode_fp8"], ("sparse_decode_fp8",),
                                     decode_problem, _stage("sparse_decode_fp8"), decode_knobs, decode_params),
        "forward_mqa": _target("forward_mqa", forward_stages, PIPELINE_STAGES,
                               lambda p, seed, device: {"batch": make_batch(p, seed, device)},
                               lambda stages, kw: forward(stages, kw["batch"]), forward_knobs, forward_params),
        "dcp_merge": _target("dcp_merge", lambda p: ["dcp_merge"], ("dcp_merge",), DCP_MERGE.inputs,
                             _stage("dcp_merge"), DCP_MERGE.knobs, merge_params),
    },
    doc="the same inputs give bitwise the same outputs run to run",
), priority=107)
