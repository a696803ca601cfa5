"""A sparse FP8 decode kernel wrong on some inputs only (issue 28's block tests): the float32 eager
kernel, its output scaled by 1.05 where the first query element is positive. Which cases fail
depends on the seed alone, so in a fuzz block some members fail and others pass."""

from __future__ import annotations

import torch

from mla_verify.optimized import eager


def decode(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float):
    out, lse = eager.sparse_decode_fp8(q, kv_cache, indices, sm_scale)
    if q.flatten()[0] > 0:
        out = (out.float() * 1.05).to(out.dtype)
    return out, lse


_STATIC: dict = {}


def static_buffer(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float):
    """The eager kernel writing into one output buffer it returns every call, as a serving kernel
    under CUDA graphs does: correct each call, overwritten by the next."""
    out, lse = eager.sparse_decode_fp8(q, kv_cache, indices, sm_scale)
    if _STATIC.get("out") is None or _STATIC["out"].shape != out.shape:
        _STATIC["out"], _STATIC["lse"] = torch.empty_like(out), torch.empty_like(lse)
    _STATIC["out"].copy_(out)
    _STATIC["lse"].copy_(lse)
    return _STATIC["out"], _STATIC["lse"]


_SCRIBBLED: list = []


def scribbles_later_queries(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float):
    """Right on its own inputs, but its first call writes the query of every other case it finds
    through the garbage collector (a block's later cases, built before the first call)."""
    if not _SCRIBBLED:
        import gc

        for obj in gc.get_objects():
            if type(obj) is dict and isinstance(obj.get("q"), torch.Tensor) and obj["q"] is not q \
                    and obj["q"].shape == q.shape and "kv_cache" in obj:
                obj["q"].fill_(0.5)
                _SCRIBBLED.append(obj["q"].data_ptr())
    return eager.sparse_decode_fp8(q, kv_cache, indices, sm_scale)


_CALLS: list = []


def dies_every_second_call(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float):
    """Right, but every second call in a process ends it (SIGKILL, as the OOM killer would): in an
    isolated block, a case answered, a case crashed, and again in the fresh worker."""
    _CALLS.append(1)
    if len(_CALLS) % 2 == 0:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    return eager.sparse_decode_fp8(q, kv_cache, indices, sm_scale)


def patches_the_judge_on_its_second_call(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                                         sm_scale: float):
    """Right, but its second call in a process rebinds torch.sub (the judge's) to a function of its own."""
    _CALLS.append(1)
    if len(_CALLS) == 2:
        torch.sub = lambda a, b, **kw: torch.zeros_like(a)
    return eager.sparse_decode_fp8(q, kv_cache, indices, sm_scale)
