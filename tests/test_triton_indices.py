"""Our Triton index conversion kernels (convert_index, dcp_convert_index) against the reference,
bit for bit, and their refusal of bad inputs before any launch (tests/triton_glue_helpers.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mla_verify import reference as R
from mla_verify.optimized.kernels.indices import convert_index, dcp_convert_index
from tests.triton_glue_helpers import (  # noqa: F401  (no_launch: a fixture)
    BLOCK_SIZES, DEVICE, TOPK, _expect_refusal, _gen, _i32, assert_same_bits, no_launch, poisoned_outputs, seeds,
)


def _shuffled_block_table(gen: torch.Generator, rows: int, cols: int, num_blocks: int) -> torch.Tensor:
    return torch.randperm(num_blocks, generator=gen)[: rows * cols].view(rows, cols).to(torch.int32)


PATTERNS = ("valid", "tail", "scattered", "negatives", "beyond", "empty_rows", "duplicates", "mixed")


def _logical_topk(gen: torch.Generator, tokens: int, topk: int, limit: int, pattern: str) -> torch.Tensor:
    """[T, K] int32 positions in [0, limit), then corrupted as `pattern` says."""
    tok = torch.randint(0, limit, (tokens, topk), generator=gen)

    def some(p: float) -> torch.Tensor:
        return torch.rand(tokens, topk, generator=gen) < p

    if pattern in ("tail", "mixed"):  # -1 tails of random lengths, the indexer's usual padding
        keep = torch.randint(0, topk + 1, (tokens, 1), generator=gen)
        tok[torch.arange(topk)[None, :] >= keep] = -1
    if pattern in ("scattered", "mixed"):
        tok[some(0.3)] = -1
    if pattern in ("negatives", "mixed"):  # any negative is invalid, not only -1
        hit = some(0.2)
        choices = torch.tensor([-2, -7, -(2**31)])
        tok[hit] = choices[torch.randint(0, 3, (int(hit.sum()),), generator=gen)]
    if pattern in ("beyond", "mixed"):  # logical positions past the block table
        hit = some(0.2)
        tok[hit] = limit + torch.randint(0, 3 * limit, (int(hit.sum()),), generator=gen)
    if pattern in ("empty_rows", "mixed"):
        tok[torch.rand(tokens, generator=gen) < 0.3] = -1
    if pattern == "duplicates":
        tok = tok[:, torch.randint(0, max(1, topk // 4), (topk,), generator=gen)]
    return tok.to(torch.int32)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 16), topk=TOPK, block_size=BLOCK_SIZES, cols=st.integers(1, 6),
    requests=st.integers(1, 4), extra_stride=st.sampled_from([None, 0, 1, 3]),
    pattern=st.sampled_from(PATTERNS), prefill_requests=st.integers(0, 3), counts=st.booleans(), seed=seeds,
)
def test_triton_convert_index_matches_reference(
    tokens, topk, block_size, cols, requests, extra_stride, pattern, prefill_requests, counts, seed
):
    gen = _gen(seed)
    block_table = _shuffled_block_table(gen, requests, cols, requests * cols + 3)
    args = dict(
        req_id=torch.randint(0, requests, (tokens,), generator=gen, dtype=torch.int32),
        block_table=block_table,
        topk_indices=_logical_topk(gen, tokens, topk, cols * block_size, pattern),
        block_size=block_size,
        block_stride_rows=None if extra_stride is None else block_size * (1 + extra_stride),
        return_valid_counts=counts,
    )
    if prefill_requests:  # decode rows (id < 0) mixed with rows of `prefill_requests` workspaces
        args["prefill_request_ids"] = torch.randint(-2, prefill_requests, (tokens,), generator=gen, dtype=torch.int32)
        args["prefill_workspace_starts"] = torch.randint(0, 1000, (prefill_requests,), generator=gen).sort().values.to(torch.int32)
    want = R.convert_index(**args)
    with poisoned_outputs():
        got = convert_index(**{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    if counts:
        assert_same_bits(got[0], want[0])
        assert_same_bits(got[1], want[1])
    else:
        assert_same_bits(got, want)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 16), topk=TOPK, block_size=BLOCK_SIZES, cols=st.integers(1, 6),
    requests=st.integers(1, 4), dcp_size=st.integers(1, 8), pattern=st.sampled_from(PATTERNS),
    compact=st.booleans(), data=st.data(), seed=seeds,
)
def test_triton_dcp_convert_index_matches_reference(
    tokens, topk, block_size, cols, requests, dcp_size, pattern, compact, data, seed
):
    rank = data.draw(st.integers(0, dcp_size - 1), label="dcp_rank")
    interleave = data.draw(st.sampled_from([i for i in (1, 2, 4, 64) if block_size % i == 0]), label="interleave")
    gen = _gen(seed)
    args = dict(
        req_id=torch.randint(0, requests, (tokens,), generator=gen, dtype=torch.int32),
        block_table=_shuffled_block_table(gen, requests, cols, requests * cols + 2),
        # Global positions: every rank's shard of `cols` local blocks.
        topk_indices=_logical_topk(gen, tokens, topk, dcp_size * cols * block_size, pattern),
        block_size=block_size, dcp_size=dcp_size, dcp_rank=rank, interleave=interleave,
        compact_valid_to_front=compact,
    )
    want = R.dcp_convert_index(**args)
    with poisoned_outputs():
        got = dcp_convert_index(**{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    assert_same_bits(got, want)


@pytest.mark.parametrize(
    "interleave, rank, compact, want",
    [
        # spec §5.3, N = 2, I = 1: tok 0 -> rank 0 local 0, 1 -> rank 1 local 0, 2 -> rank 0 local 1 ...
        (1, 0, False, [320, -1, 321, -1, 322, -1, 323, -1, 324, -1, 325, -1]),
        (1, 1, False, [-1, 320, -1, 321, -1, 322, -1, 323, -1, 324, -1, 325]),
        # N = 2, I = 4: tok 0-3 -> rank 0 local 0-3, 4-7 -> rank 1 local 0-3, 8-11 -> rank 0 local 4-7
        (4, 0, False, [320, 321, 322, 323, -1, -1, -1, -1, 324, 325, 326, 327]),
        (4, 1, False, [-1, -1, -1, -1, 320, 321, 322, 323, -1, -1, -1, -1]),
        (4, 1, True, [320, 321, 322, 323] + [-1] * 8),
    ],
)
def test_triton_dcp_convert_index_ownership_examples(interleave, rank, compact, want):
    # One request whose local block 0 is physical block 5: phys = 5 * 64 + local.
    got = dcp_convert_index(
        req_id=torch.tensor([0], dtype=torch.int32, device=DEVICE),
        block_table=torch.tensor([[5]], dtype=torch.int32, device=DEVICE),
        topk_indices=torch.arange(12, dtype=torch.int32, device=DEVICE)[None, :],
        block_size=64, dcp_size=2, dcp_rank=rank, interleave=interleave, compact_valid_to_front=compact,
    )
    assert got.cpu().tolist() == [want]


def test_triton_convert_index_worked_example():
    # Block stride 3 * 16 rows (other layers' pages between blocks); row 1 is a prefill row.
    out, counts = convert_index(
        req_id=torch.tensor([1, 0], dtype=torch.int32, device=DEVICE),
        block_table=torch.tensor([[7, 2], [4, 9]], dtype=torch.int32, device=DEVICE),
        topk_indices=torch.tensor([[17, -1, 3, 40, -5, 16], [5, 31, 32, -1, 0, 2]], dtype=torch.int32, device=DEVICE),
        block_size=16, block_stride_rows=48,
        prefill_request_ids=torch.tensor([-1, 1], dtype=torch.int32, device=DEVICE),
        prefill_workspace_starts=torch.tensor([0, 100], dtype=torch.int32, device=DEVICE),
        return_valid_counts=True,
    )
    # Row 0 (request 1): 17 -> 9*48+1 = 433, 3 -> 4*48+3 = 195, 40 is block 2 of 2 (invalid),
    # 16 -> 9*48 = 432. Row 1 (workspace starting at 100): 5, 31, 0, 2 -> 105, 131, 100, 102;
    # 32 is block 2 (invalid, even in a workspace).
    assert out.cpu().tolist() == [[433, 195, 432, -1, -1, -1], [105, 131, 100, 102, -1, -1]]
    assert counts.cpu().tolist() == [3, 4]


_INDEX_BASE = dict(
    req_id=_i32(0, 1), block_table=torch.tensor([[3, 1], [0, 2]], dtype=torch.int32),
    topk_indices=torch.tensor([[0, 17, -1], [5, 31, 2]], dtype=torch.int32), block_size=16,
)


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(topk_indices=torch.tensor([[0, 17, -1], [5, 31, 2]])), "topk_indices: expected dtype int32, got int64"),
        (dict(req_id=_i32(0, 1, 1)), r"req_id: expected shape \(2,\), got \(3,\)"),  # vLLM bug #47327
        (dict(req_id=_i32(0, 2)), r"req_id: entry \(1,\) is 2, outside \[0, 2\)"),
        (dict(block_table=torch.tensor([3, 1], dtype=torch.int32)), "block_table: expected 2 dims"),
        (dict(topk_indices=torch.ones(2, 0, dtype=torch.int32)), "K .dim 1. must be positive"),
        (dict(block_size=0), "block_size must be positive"),
        (dict(block_stride_rows=8), "blocks would overlap"),
        (dict(prefill_request_ids=_i32(-1, 0)), "come together"),
        (dict(prefill_request_ids=_i32(-1, 1), prefill_workspace_starts=_i32(0)), r"prefill_request_ids: entry \(1,\) is 1"),
        (dict(prefill_request_ids=_i32(-1), prefill_workspace_starts=_i32(0)), r"prefill_request_ids: expected shape \(2,\)"),
        (dict(block_table=torch.tensor([[2**27, 1], [0, 2]], dtype=torch.int32)), "does not fit the int32"),
    ],
)
def test_triton_convert_index_refuses_bad_inputs_before_launch(no_launch, override, match):
    _expect_refusal(convert_index, _INDEX_BASE, override, match)


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(dcp_rank=2), r"dcp_rank=2 is outside \[0, dcp_size=2\)"),
        (dict(dcp_size=0, dcp_rank=0), "dcp_size must be at least 1"),
        (dict(interleave=3), "interleave=3 must be positive and divide block_size=16"),
        (dict(req_id=_i32(0)), r"req_id: expected shape \(2,\)"),
    ],
)
def test_triton_dcp_convert_index_refuses_bad_inputs_before_launch(no_launch, override, match):
    base = dict(_INDEX_BASE, dcp_size=2, dcp_rank=1, interleave=4, compact_valid_to_front=False)
