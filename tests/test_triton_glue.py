"""Our Triton glue kernels against the reference: index conversion, gather + up-convert, the
fp8_ds_mla writer and reader, the DCP merge and the MLA query concat.

Exact contracts (indices, cache bytes, bf16 bits) are compared bit for bit; the DCP merge is held
to the rounding bound derived in `mla_verify.equivalence.bounds`. Kernel outputs are allocated poisoned (NaN,
0xFF bytes, 0x5A5A5A5A int32) so an element a kernel forgets to write shows. Hypothesis draws the
structure and an integer seed; every tensor comes from `torch.Generator().manual_seed(seed)`.
Test names carry the name of the Triton entry point they run.
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, note, settings, strategies as st

from mla_verify import reference as R
from mla_verify.equivalence.bounds import dcp_merge_bounds
from mla_verify.equivalence.values import REGIMES, kv_values
from mla_verify.optimized import buffers
from mla_verify.optimized.kernels import cache_writer, concat, dcp_merge as merge_kernels, gather, indices, launch
from mla_verify.optimized.kernels.bits import e2m1_bits_to_f32, e4m3_bits_to_f32
from mla_verify.optimized.kernels.cache_writer import dequantize_fp8_ds_mla, quantize_fp8_ds_mla, write_fp8_ds_mla_cache
from mla_verify.optimized.kernels.concat import concat_mla_q
from mla_verify.optimized.kernels.dcp_merge import dcp_lse_correct, dcp_merge
from mla_verify.optimized.kernels.gather import gather_upconvert_fp8, gather_upconvert_nvfp4
from mla_verify.optimized.kernels.indices import convert_index, dcp_convert_index
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


def _shuffled_block_table(gen: torch.Generator, rows: int, cols: int, num_blocks: int) -> torch.Tensor:
    return torch.randperm(num_blocks, generator=gen)[: rows * cols].view(rows, cols).to(torch.int32)


# ---------------------------------------------------------------------------------------------
# Index conversion

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


# ---------------------------------------------------------------------------------------------
# Gather + up-convert

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


# ---------------------------------------------------------------------------------------------
# fp8_ds_mla writer and reader

def _on_device(t: torch.Tensor, strided: bool) -> torch.Tensor:
    """`t` on DEVICE: packed, or as a row-strided view at an odd offset into a wider junk buffer
    (built on DEVICE, since moving a view between devices packs it)."""
    if not strided:
        return t.to(DEVICE)
    junk = 0xEE if t.dtype == torch.uint8 else float("nan")
    wide = torch.full((t.shape[0], t.shape[1] + 40), junk, dtype=t.dtype, device=DEVICE)
    view = wide[:, 7 : 7 + t.shape[1]]
    view.copy_(t)
    return view


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 40), regime=st.sampled_from(KV_REGIMES), rule=st.sampled_from(["pow2", "raw"]),
    strided=st.booleans(), seed=seeds,
)
def test_triton_quantize_and_dequantize_fp8_ds_mla_match_reference(n, regime, rule, strided, seed):
    gen = _gen(seed)
    kv = _kv(gen, n, regime)
    want = R.quantize_fp8_ds_mla(kv, rule)
    with poisoned_outputs():
        got = quantize_fp8_ds_mla(_on_device(kv, strided), scale_rule=rule)
    assert_same_bits(got, want)
    with poisoned_outputs():
        back = dequantize_fp8_ds_mla(_on_device(want, strided))
    assert_same_bits(back, R.dequantize_fp8_ds_mla(want))


def test_triton_quantize_fp8_ds_mla_worked_example():
    # vLLM's regression example: amax 336 -> 336/448 = 0.75 -> scale 1.0; a zero tile -> 1e-4 ->
    # 2**-13 exactly. 336 lies halfway between e4m3 320 and 352: ties to even, 320 = 0x7A.
    kv = torch.zeros(1, 576, dtype=torch.bfloat16)
    kv[0, :384] = 336.0
    kv[0, 512:] = torch.arange(64) - 31.5
    rows = quantize_fp8_ds_mla(kv.to(DEVICE)).cpu()
    assert rows[0, 512:528].tolist() == [0, 0, 0x80, 0x3F] * 3 + [0, 0, 0, 0x39]  # 1.0f x3, 2**-13
    assert rows[0, :384].tolist() == [0x7A] * 384 and rows[0, 384:512].tolist() == [0] * 128
    assert torch.equal(rows[0, 528:].view(torch.bfloat16), kv[0, 512:])
    assert_same_bits(rows, R.quantize_fp8_ds_mla(kv, "pow2"))


@pytest.mark.parametrize("rule", ["pow2", "raw"])
def test_triton_quantize_fp8_ds_mla_leaves_nan_out_of_amax(rule):
    # As the CUDA writer's fmaxf reduction: a NaN does not set its tile's scale, and itself
    # becomes e4m3 NaN. (Outside the reference's contract, which takes finite rows.)
    kv = kv_values(torch.Generator().manual_seed(11), 2, "normal")
    finite = kv.clone()
    kv[0, 5], kv[1, 300], finite[0, 5], finite[1, 300] = math.nan, -math.nan, 0.0, 0.0
    got = quantize_fp8_ds_mla(kv.to(DEVICE), scale_rule=rule).cpu()
    want = R.quantize_fp8_ds_mla(finite, rule)
    nan_at = torch.zeros_like(got, dtype=torch.bool)
    nan_at[0, 5] = nan_at[1, 300] = True
    assert_same_bits(got[~nan_at], want[~nan_at])
    assert all(int(b) & 0x7F == 0x7F for b in got[nan_at])


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 24), block_size=BLOCK_SIZES, num_blocks=st.integers(1, 5), layers=st.integers(1, 3),
    skipped=st.floats(0, 0.5), slot_dtype=st.sampled_from([torch.int32, torch.int64]),
    rule=st.sampled_from(["pow2", "raw"]), regime=st.sampled_from(KV_REGIMES), seed=seeds,
)
def test_triton_write_fp8_ds_mla_cache_matches_reference(
    n, block_size, num_blocks, layers, skipped, slot_dtype, rule, regime, seed
):
    gen = _gen(seed)
    capacity = num_blocks * block_size
    n = min(n, capacity)  # distinct slots: two tokens writing one slot race, as upstream
    kv = _kv(gen, n, regime)
    slots = torch.randperm(capacity, generator=gen)[:n]
    slots[torch.rand(n, generator=gen) < skipped] = -1
    layer = int(torch.randint(0, layers, (1,), generator=gen))
    store = torch.randint(0, 256, (num_blocks, layers, block_size, 656), generator=gen, dtype=torch.int32).to(torch.uint8)
    want = store.clone()
    R.write_fp8_ds_mla_cache(kv, want[:, layer], slots, rule)
    got = store.to(DEVICE)
    write_fp8_ds_mla_cache(kv.to(DEVICE), got[:, layer], slots.to(slot_dtype).to(DEVICE), scale_rule=rule)
    assert_same_bits(got, want)  # written rows, and every byte it must not touch


# ---------------------------------------------------------------------------------------------
# DCP merge

# The merge is held to the rounding bound of mla_verify.equivalence.bounds (section 3).

_EMPTINESS = ("none", "some", "junk", "all")


def _dcp_partials(gen: torch.Generator, ranks: int, tokens: int, heads: int, dim: int, empties: str):
    """Per-rank (outs [N, T, H, D] bf16, lses [N, T, H] f32) as the decode kernels leave them.

    "some": ranks owning none of a row's tokens are neutralized (0, -inf); "junk": such ranks keep
    FlashMLA's lonely-row answer (lse +inf or NaN, out NaN/inf); "all": whole rows where every
    rank is empty.
    """
    outs = torch.randn(ranks, tokens, heads, dim, generator=gen)
    lses = (torch.randn(ranks, tokens, heads, generator=gen) * 4 + 2).float()
    empty = torch.rand(ranks, tokens, heads, generator=gen) < (0.0 if empties == "none" else 0.4)
    if empties == "all":
        empty[:, torch.rand(tokens, generator=gen) < 0.5] = True
    if empties == "junk":
        lses[empty] = torch.where(torch.rand(int(empty.sum()), generator=gen) < 0.5, math.inf, math.nan)
        outs[empty] = torch.tensor([math.nan, math.inf, -math.inf])[torch.randint(0, 3, (int(empty.sum()),), generator=gen)][:, None]
    else:
        lses[empty] = -math.inf
        outs[empty] = 0.0
    return outs.to(torch.bfloat16), lses


# The interpreter's numpy warns on the -inf and NaN arithmetic the merge resolves on purpose.
_IGNORE_NUMPY_WARNINGS = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


@_IGNORE_NUMPY_WARNINGS
@settings(max_examples=30, deadline=None)
@given(
    ranks=st.integers(1, 8), tokens=st.integers(1, 4), heads=st.integers(1, 9),
    dim=st.sampled_from([16, 100, 512]), empties=st.sampled_from(_EMPTINESS), seed=seeds,
)
def test_triton_dcp_merge_and_dcp_lse_correct_match_reference(ranks, tokens, heads, dim, empties, seed):
    outs, lses = _dcp_partials(_gen(seed), ranks, tokens, heads, dim, empties)
    out_ref, lse_ref = R.dcp_merge(outs, lses)
    with poisoned_outputs():
        out, lse = dcp_merge(outs.to(DEVICE), lses.to(DEVICE))
    out, lse = out.cpu(), lse.cpu()
    assert not out.isnan().any() and not lse.isnan().any()
    tol_out, tol_lse = dcp_merge_bounds(outs, lses, out_ref, lse_ref)
    assert torch.equal(lse.isinf(), lse_ref.isinf()) and torch.equal(lse[lse.isinf()], lse_ref[lse_ref.isinf()].float())
    finite = lse_ref.isfinite()
    assert bool(((lse.double() - lse_ref).abs()[finite] <= tol_lse[finite]).all()), "lse outside its bound"
    excess = (out.double() - out_ref).abs() - tol_out
    assert bool((excess <= 0).all()), f"out exceeds its bound by {excess.max().item():.3g}"

    # The per-rank kernel is the same arithmetic: its bf16 partials, summed in fp32 in rank
    # order and rounded once, are the merged output bit for bit, with the same L.
    total = torch.zeros(tokens, heads, dim)
    for r in range(ranks):
        with poisoned_outputs():
            scaled, lse_r = dcp_lse_correct(outs[r].to(DEVICE), lses.to(DEVICE), rank=r)
        assert_same_bits(lse_r, lse)
        total += scaled.cpu().float()
    assert_same_bits(total.to(torch.bfloat16), out)


@_IGNORE_NUMPY_WARNINGS
def test_triton_dcp_merge_single_rank_is_identity():
    # N = 1: L = lse exactly, f = exp(0) = 1, so the merge returns the rank's output bit for bit.
    gen = torch.Generator().manual_seed(7)
    outs = torch.randn(1, 3, 5, 64, generator=gen).to(torch.bfloat16)
    lses = torch.randn(1, 3, 5, generator=gen) * 10
    out, lse = dcp_merge(outs.to(DEVICE), lses.to(DEVICE))
    assert_same_bits(out, outs[0])
    assert_same_bits(lse, lses[0])


# ---------------------------------------------------------------------------------------------
# Query concat

@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 8), heads=st.integers(1, 20), layout=st.sampled_from(["packed", "sliced", "transposed"]), seed=seeds)
def test_triton_concat_mla_q_matches_reference(tokens, heads, layout, seed):
    gen = _gen(seed)

    def bits(*shape):  # arbitrary bf16 bit patterns, NaN payloads included
        return torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)

    # Each layout: base tensors, and how to cut ql_nope and q_pe out of them (cut on each device,
    # since moving a view between devices packs it).
    if layout == "packed":
        bases, cut = (bits(tokens, heads, 512), bits(tokens, heads, 64)), lambda a, b: (a, b)
    elif layout == "sliced":  # the halves of a wider projection output
        bases, cut = (bits(tokens, heads, 700),), lambda w: (w[:, :, 100:612], w[:, :, 620:684])
    else:
        bases = (bits(heads, tokens, 512), bits(heads, 64, tokens))
        cut = lambda a, b: (a.transpose(0, 1), b.permute(2, 0, 1))  # noqa: E731
    with poisoned_outputs():
        got = concat_mla_q(*cut(*(b.to(DEVICE) for b in bases)))
    assert_same_bits(got, R.concat_mla_q(*cut(*bases)))


# ---------------------------------------------------------------------------------------------
# Exact conversions the kernels share

@triton.jit
def _decode_kernel(codes, e4m3, e2m1):
    i = tl.arange(0, 256)
    b = tl.load(codes + i)
    tl.store(e4m3 + i, e4m3_bits_to_f32(b))
    tl.store(e2m1 + i, e2m1_bits_to_f32(b))


def test_triton_bits_decoders_match_torch_including_negative_zero():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    e4m3 = torch.full((256,), math.nan, device=DEVICE)
    e2m1 = torch.full((256,), math.nan, device=DEVICE)
    _decode_kernel[(1,)](codes.to(DEVICE), e4m3, e2m1)
    want = codes.view(torch.float8_e4m3fn).float()
    nan = want.isnan()
    assert torch.equal(e4m3.cpu().isnan(), nan)
    assert_same_bits(e4m3.cpu()[~nan], want[~nan])  # 0x80 is -0.0, not +0.0
    magnitudes = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    assert_same_bits(e2m1.cpu(), torch.cat([magnitudes, -magnitudes])[(codes & 0xF).long()])


# ---------------------------------------------------------------------------------------------
# Validation: every bad input is refused with an InputError before any kernel launches

class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("kernel launched")


@pytest.fixture
def no_launch(monkeypatch):
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
    _expect_refusal(dcp_convert_index, base, override, match)


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


_WRITE_BASE = dict(
    kv=torch.ones(3, 576, dtype=torch.bfloat16), kv_cache=torch.full((4, 16, 656), 0x11, dtype=torch.uint8),
    slot_mapping=torch.tensor([5, -1, 63]),
)


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(slot_mapping=torch.tensor([5, -1, 64])), r"slot_mapping: entry \(2,\) is 64, outside"),
        (dict(slot_mapping=torch.tensor([5.0, -1.0, 63.0])), "slot_mapping: expected dtype int32 or int64"),
        (dict(slot_mapping=torch.tensor([5, 63])), r"slot_mapping: expected shape \(3,\)"),
        (dict(kv=torch.ones(3, 576)), "kv: expected dtype bfloat16, got float32"),
        (dict(kv=torch.ones(3, 575, dtype=torch.bfloat16)), "kv: expected shape"),
        (dict(kv_cache=torch.ones(4, 16, 656, dtype=torch.int8)), "kv_cache: expected dtype uint8"),
        (dict(kv_cache=torch.full((4, 32, 656), 0x11, dtype=torch.uint8)[:, ::2]), "packed 656-byte rows"),
        (dict(scale_rule="ue8m0"), "scale_rule='ue8m0' is not one of"),
    ],
)
def test_triton_write_fp8_ds_mla_cache_refuses_bad_inputs_before_launch(no_launch, override, match):
    _expect_refusal(write_fp8_ds_mla_cache, _WRITE_BASE, override, match)


def test_triton_quantize_and_dequantize_fp8_ds_mla_refuse_bad_inputs_before_launch(no_launch):
    kv = torch.ones(2, 576, dtype=torch.bfloat16)
    _expect_refusal(quantize_fp8_ds_mla, dict(kv=kv), dict(kv=kv.half()), "kv: expected dtype bfloat16, got float16")
    _expect_refusal(quantize_fp8_ds_mla, dict(kv=kv), dict(scale_rule="pow4"), "scale_rule")
    rows = torch.full((2, 656), 0x11, dtype=torch.uint8)
    _expect_refusal(dequantize_fp8_ds_mla, dict(rows=rows), dict(rows=rows[:, :352]), r"rows: expected shape .*, got \(2, 352\)")


def test_triton_dcp_merge_and_dcp_lse_correct_refuse_bad_inputs_before_launch(no_launch):
    outs, lses = torch.ones(2, 3, 4, 64, dtype=torch.bfloat16), torch.ones(2, 3, 4)
    merge = dict(outs=outs, lses=lses)
    _expect_refusal(dcp_merge, merge, dict(lses=lses.double()), "lses: expected dtype float32, got float64")
    _expect_refusal(dcp_merge, merge, dict(lses=torch.ones(2, 3, 5)), r"lses: expected shape \(2, 3, 4\)")
    _expect_refusal(dcp_merge, merge, dict(outs=outs.float()), "outs: expected dtype bfloat16")
    correct = dict(out_r=outs[0], lses=lses, rank=1)
    _expect_refusal(dcp_lse_correct, correct, dict(rank=2), r"rank=2 is outside \[0, N=2\)")
    _expect_refusal(dcp_lse_correct, correct, dict(out_r=outs[0, :2]), r"out_r: expected shape \(3, 4, '\*'\)")


def test_triton_concat_mla_q_refuses_bad_inputs_before_launch(no_launch):
    base = dict(ql_nope=torch.ones(2, 3, 512, dtype=torch.bfloat16), q_pe=torch.ones(2, 3, 64, dtype=torch.bfloat16))
    _expect_refusal(concat_mla_q, base, dict(q_pe=torch.ones(2, 3, 32, dtype=torch.bfloat16)), r"q_pe: expected shape \(2, 3, 64\)")
    _expect_refusal(concat_mla_q, base, dict(q_pe=torch.ones(1, 3, 64, dtype=torch.bfloat16)), r"q_pe: expected shape \(2, 3, 64\)")
    _expect_refusal(concat_mla_q, base, dict(ql_nope=torch.ones(2, 3, 512)), "ql_nope: expected dtype bfloat16")


def test_triton_kernels_refuse_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    with pytest.raises(InputError, match="TRITON_INTERPRET=1"):
        quantize_fp8_ds_mla(torch.ones(2, 576, dtype=torch.bfloat16))
