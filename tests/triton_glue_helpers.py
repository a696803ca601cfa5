"""Shared helpers of the Triton glue kernel tests (tests/test_triton_*.py): seeded generators,
poisoned outputs, bit-for-bit comparison, the no-launch fixture and refusal checks.

Kernel outputs are allocated poisoned (NaN, 0xFF bytes, 0x5A5A5A5A int32) so an element a kernel
forgets to write shows. Hypothesis draws the structure and an integer seed; every tensor comes
from `torch.Generator().manual_seed(seed)`. Test names carry the name of the Triton entry point
they run.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import note, strategies as st

from mla_verify.equivalence.cases.values import REGIMES, kv_values
from mla_verify.optimized import buffers
from mla_verify.optimized.kernels import cache_writer, concat, dcp_merge as merge_kernels, gather, indices
from mla_verify.optimized.validation import InputError

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
seeds = st.integers(0, 2**31 - 1)
TOPK = st.sampled_from([1, 37, 64, 128, 192, 256, 384, 1100])  # 1100: more than one 1024-wide tile
BLOCK_SIZES = st.sampled_from([16, 64, 128])
KV_REGIMES = REGIMES + ("subnormal",)  # subnormal: bf16 values below 2**-126 (raw scales see them)
INT_POISON = 0x5A5A5A5A  # neither -1 nor a plausible row number


def _gen(seed: int) -> torch.Generator:
    note(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@contextlib.contextmanager
def poisoned_outputs():
    """The harness's output poisoning (optimized.buffers: NaN floats, 0xFF bytes), except that
    int32 outputs get 0x5A5A5A5A: the harness's -1 would hide an index kernel's unwritten -1."""
    plain = buffers.empty

    def empty(shape, dtype, device):
        t = plain(shape, dtype, device)
        return t.fill_(INT_POISON) if dtype == torch.int32 else t

    with buffers.poisoned(), mock.patch.object(buffers, "empty", empty):
        yield


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    g, w = _bits(got), _bits(want)
    if not torch.equal(g, w):
        bad = (g != w).nonzero()
        first = tuple(bad[0].tolist())
        raise AssertionError(
            f"{len(bad)} of {g.numel()} elements differ; first at {first}: got {g[first].item()}, "
            f"want {w[first].item()}"
        )


def _kv(gen: torch.Generator, n: int, regime: str) -> torch.Tensor:
    if regime == "subnormal":
        return (kv_values(gen, n, "normal").float() * 2.0**-130).to(torch.bfloat16)
    return kv_values(gen, n, regime)


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("kernel launched")


@pytest.fixture
def no_launch(monkeypatch):
    """Every glue kernel raises if launched: validation must refuse bad inputs before any launch."""
    kernels = (
        (indices, "_convert_kernel"), (gather, "_gather_kernel"), (cache_writer, "_quantize_kernel"),
        (cache_writer, "_dequantize_kernel"), (merge_kernels, "_merge_kernel"),
        (merge_kernels, "_lse_correct_kernel"), (concat, "_concat_kernel"),
    )
    for module, name in kernels:
        monkeypatch.setattr(module, name, _NoLaunch())


def _i32(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _expect_refusal(fn, base: dict, override: dict, match: str) -> None:
    """`base` passes validation (it reaches the launch); `base | override` is refused."""
    with pytest.raises(AssertionError, match="kernel launched"):
        fn(**base)
    with pytest.raises(InputError, match=match):
        fn(**{**base, **override})
