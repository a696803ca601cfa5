"""Our Triton gather + up-convert kernels (fp8_ds_mla and nvfp4_ds_mla pages to bf16 workspace
rows) against the reference, bit for bit, and their refusal of bad inputs before any launch.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import settings, given, strategies as st

from mla_verify import reference as R
from mla_verify.optimized.kernels.gather import gather_upconvert_fp8, gather_upconvert_nvfp4
from tests.triton_glue_helpers import (  # noqa: F401  (no_launch: a fixture)
    BLOCK_SIZES, DEVICE, KV_REGIMES, _expect_refusal, _gen, _i32, _kv, assert_same_bits, no_launch, poisoned_outputs,
    seeds,
)


def _paged_cache(gen: torch.Generator, rows: torch.Tensor, block_size: int, layers: int, layer: int) -> torch.Tensor:
    """Quantized rows [NB * BS, W] laid out as layer `layer` of a cache whose blocks hold every
    layer's page ([NB, layers, BS, W] storage, so stride(0) = layers * BS * W); the other layers
    are random bytes."""
    num_blocks, width = rows.shape[0] // block_size, rows.shape[1]
    store = torch.randint(0, 256, (num_blocks, layers, block_size, width), generator=gen, dtype=torch.int32).to(torch.uint8)
    store[:, layer] = rows.view(num_blocks, block_size, width)
    return store.to(DEVICE)[:, layer]


def _check_gather(kernel, reference, quantize, block_size, lens, layers, spare_blocks, spare_cols, regime, seed):
    gen = _gen(seed)
    blocks_each = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(blocks_each) + spare_blocks
    layer = int(torch.randint(0, layers, (1,), generator=gen))
    cache = _paged_cache(gen, quantize(_kv(gen, num_blocks * block_size, regime)), block_size, layers, layer)
    # Each request gets its own shuffled blocks; columns it never reads hold junk ids the
    # kernel must not touch.
    cols = max(blocks_each) + spare_cols
    block_table = torch.randint(num_blocks, 2**30, (len(lens), cols), generator=gen, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    used = 0
    for r, n in enumerate(blocks_each):
        block_table[r, :n] = perm[used : used + n]
        used += n
    starts = torch.tensor([0] + lens[:-1], dtype=torch.int64).cumsum(0).to(torch.int32)
    num_rows = sum(lens)
    want = reference(kv_cache=cache.cpu(), block_table=block_table, workspace_starts=starts, num_rows=num_rows)
    with poisoned_outputs():
        got = kernel(kv_cache=cache, block_table=block_table.to(DEVICE), workspace_starts=starts.to(DEVICE), num_rows=num_rows)
    assert_same_bits(got, want)


_gather_shapes = dict(
    block_size=BLOCK_SIZES,
    # A 0 is an empty request (a repeated start).
    lens=st.lists(st.integers(0, 150), min_size=1, max_size=4).filter(lambda lens: sum(lens) > 0),
    layers=st.integers(1, 3), spare_blocks=st.integers(0, 3), spare_cols=st.integers(0, 2),
    regime=st.sampled_from(KV_REGIMES), seed=seeds,
)


@settings(max_examples=25, deadline=None)
@given(rule=st.sampled_from(["pow2", "raw"]), **_gather_shapes)
def test_triton_gather_upconvert_fp8_matches_reference(rule, **shapes):
    _check_gather(
        gather_upconvert_fp8, R.gather_upconvert_fp8, lambda kv: R.quantize_fp8_ds_mla(kv, rule), **shapes
    )


@settings(max_examples=20, deadline=None)
@given(rounding=st.sampled_from(["up", "rn"]), **_gather_shapes)
def test_triton_gather_upconvert_nvfp4_matches_reference(rounding, **shapes):
    _check_gather(
        gather_upconvert_nvfp4, R.gather_upconvert_nvfp4, lambda kv: R.quantize_nvfp4_ds_mla(kv, rounding), **shapes
    )


def _gather_base(width: int) -> dict:
    # Request 0: rows 0-19 (blocks 2, 0); request 1: rows 20-29 (block 1); column 1 of request 1
    # is never read, so its junk id is fine.
    return dict(
        kv_cache=torch.full((4, 16, width), 0x11, dtype=torch.uint8),
        block_table=torch.tensor([[2, 0], [1, 99]], dtype=torch.int32),
        workspace_starts=_i32(0, 20), num_rows=30,
    )


@pytest.mark.parametrize("kernel, width", [(gather_upconvert_fp8, 656), (gather_upconvert_nvfp4, 352)])
@pytest.mark.parametrize(
    "override, match",
    [
        (dict(kv_cache=torch.ones(4, 16, 328, dtype=torch.bfloat16)), "kv_cache: expected dtype uint8"),
        (dict(kv_cache=torch.ones(4, 16, 600, dtype=torch.uint8)), "kv_cache: expected shape"),
        (dict(workspace_starts=_i32(3, 20)), r"workspace_starts\[0\] must be 0"),
        (dict(workspace_starts=_i32(0, 20, 10), block_table=torch.ones(3, 2, dtype=torch.int32)), "ascending: entry 2 is 10 after 20"),
        (dict(workspace_starts=_i32(0)), r"workspace_starts: expected shape \(2,\)"),
        (dict(num_rows=53), "request 1 reach token 32, block 2, but block_table has 2 columns"),
        (dict(block_table=torch.tensor([[2, 0], [4, 99]], dtype=torch.int32)), r"entry \(1, 0\) is 4, outside \[0, 4\)"),
        (dict(block_table=torch.tensor([[2, -1], [1, 99]], dtype=torch.int32)), r"entry \(0, 1\) is -1"),
        (dict(num_rows=-1), "num_rows must be a non-negative int"),
        (dict(block_table=torch.ones(2, 2, dtype=torch.int64)), "block_table: expected dtype int32"),
    ],
)
def test_triton_gather_upconvert_refuses_bad_inputs_before_launch(no_launch, kernel, width, override, match):
    _expect_refusal(kernel, _gather_base(width), override, match)


@pytest.mark.parametrize("kernel, width", [(gather_upconvert_fp8, 656), (gather_upconvert_nvfp4, 352)])
def test_triton_gather_upconvert_refuses_unpacked_cache_rows(no_launch, kernel, width):
    base = _gather_base(width)
    spaced = torch.full((4, 32, width), 0x11, dtype=torch.uint8)[:, ::2]  # stride(1) = 2 rows
    _expect_refusal(kernel, base, dict(kv_cache=spaced), f"packed {width}-byte rows")
