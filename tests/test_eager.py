"""optimized/eager/ op by op: the exact ops (cache bytes, index conversion, workspace gather,
query concat) bit for bit against the reference; the prefill op with sinks, topk_length and every
invalid-index form within the fp32 model of mla_verify.equivalence.judge.bounds; the merge on junk; input checks.
Every output is allocated poisoned, so an unwritten element shows."""

import math

import pytest
import torch
from hypothesis import given, strategies as st

from mla_verify import reference as R
from mla_verify.equivalence.cases.values import REGIMES, kv_values, q_values
from mla_verify.optimized import buffers, eager as E, spec_decode
from mla_verify.optimized.validation import InputError
from mla_verify.equivalence.judge.bounds import ErrorModel, fp32_merge_bounds
from tests.bound_checks import check_against_reference

seeds = st.integers(0, 2**31 - 1)


def same_bits(a, b):
    """Bit equality: unlike ==, it tells -0 from 0 and compares NaNs."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


@given(seed=seeds, n=st.integers(1, 40), regime=st.sampled_from(REGIMES), rule=st.sampled_from(["pow2", "raw"]))
def test_quantize_and_dequantize_are_bit_exact(seed, n, regime, rule):
    kv = kv_values(torch.Generator().manual_seed(seed), n, regime)
    with buffers.poisoned():
        rows = E.quantize_fp8_ds_mla(kv=kv, scale_rule=rule)
        back = E.dequantize_fp8_ds_mla(rows=rows)
    assert same_bits(rows, R.quantize_fp8_ds_mla(kv, rule))
    assert same_bits(back, R.dequantize_fp8_ds_mla(rows))


def test_e4m3_rounding_is_exact_on_every_bf16_value_below_448():
    # Each tile holds 448 (so the pow2 scale is exactly 1) and 127 bf16 values of the sweep: every
    # finite bf16 magnitude up to 448, both signs, including e4m3 ties and subnormals.
    mags = torch.arange(0, 0x43E0 + 1, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    sweep = torch.cat([mags, -mags])
    per_row = 4 * 127
    sweep = torch.cat([sweep, sweep[: (-len(sweep)) % per_row]]).view(-1, 4, 127)
    kv = torch.ones(sweep.shape[0], 576, dtype=torch.bfloat16)
    tiles = kv[:, :512].view(-1, 4, 128)
    tiles[..., 0] = 448.0
    tiles[..., 1:] = sweep
    with buffers.poisoned():
        got = E.quantize_fp8_ds_mla(kv=kv, scale_rule="pow2")
    assert same_bits(got, R.quantize_fp8_ds_mla(kv, "pow2"))


@given(seed=seeds, n=st.integers(1, 30))
def test_dequantize_reads_arbitrary_codes_and_scales(seed, n):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 256, (n, 656), generator=g, dtype=torch.uint8)
    rows[:, :512] &= torch.where(rows[:, :512] % 128 == 127, 0xFE, 0xFF).to(torch.uint8)  # no NaN codes
    scales = torch.exp2(torch.randint(-20, 10, (n, 4), generator=g).float()) * (1 + torch.rand(n, 4, generator=g))
    rows[:, 512:528] = scales.view(torch.uint8)
    rows[:, 528:] = q_values(g, (n, 64), "normal").view(torch.uint8)
    with buffers.poisoned():
        got = E.dequantize_fp8_ds_mla(rows=rows)
    assert same_bits(got, R.dequantize_fp8_ds_mla(rows))


@given(seed=seeds, n=st.integers(1, 30), pad=st.sampled_from([0, 3]), rule=st.sampled_from(["pow2", "raw"]))
def test_cache_write_is_bit_exact_on_a_strided_cache(seed, n, pad, rule):
    g = torch.Generator().manual_seed(seed)
    kv = kv_values(g, n, "outliers")
    num_blocks, bs = 4, 16
    slots = torch.randperm(num_blocks * bs, generator=g)[:n]
    slots[torch.rand(n, generator=g) < 0.2] = -1  # tokens not cached
    caches = []
    for _ in range(2):
        storage = torch.full((num_blocks, bs + pad, 656), 0xFF, dtype=torch.uint8)
        caches.append(storage[:, :bs])
    E.write_fp8_ds_mla_cache(kv=kv, kv_cache=caches[0], slot_mapping=slots, scale_rule=rule)
    R.write_fp8_ds_mla_cache(kv, caches[1], slots, rule)
    assert torch.equal(caches[0]._base, caches[1]._base)  # the padding rows untouched as well


@given(seed=seeds, fmt=st.sampled_from(["fp8", "nvfp4"]), lens=st.lists(st.integers(0, 40), min_size=1, max_size=5),
       bs=st.sampled_from([4, 16]), pad=st.sampled_from([0, 2]))
def test_gather_upconvert_is_bit_exact(seed, fmt, lens, bs, pad):
    g = torch.Generator().manual_seed(seed)
    width = 656 if fmt == "fp8" else 352
    width_blocks = max(-(-n // bs) for n in lens) or 1
    num_blocks = len(lens) * width_blocks + 1
    storage = torch.full((num_blocks, bs + pad, width), 0xFF, dtype=torch.uint8)
    cache = storage[:, :bs]
    kv = kv_values(g, num_blocks * bs, "normal")
    slots = torch.arange(num_blocks * bs)
    (R.write_fp8_ds_mla_cache if fmt == "fp8" else R.write_nvfp4_ds_mla_cache)(kv, cache, slots)
    table = torch.randperm(num_blocks, generator=g)[: len(lens) * width_blocks].view(len(lens), width_blocks)
    table = table.to(torch.int32)
    starts = torch.tensor([0] + lens[:-1]).cumsum(0).to(torch.int32)  # zero-length requests repeat a start
    with buffers.poisoned():
        got = getattr(E, f"gather_upconvert_{fmt}")(kv_cache=cache, block_table=table, workspace_starts=starts,
                                                     num_rows=sum(lens))
    want = getattr(R, f"gather_upconvert_{fmt}")(cache, table, starts, sum(lens))
    assert same_bits(got, want)


def random_conversion_inputs(g, tokens, topk, bs, reqs=3, width=4):
    table = torch.randint(0, 50, (reqs, width), generator=g, dtype=torch.int32)
    req_id = torch.randint(0, reqs, (tokens,), generator=g, dtype=torch.int32)
    # Negatives of every size, in-table positions, and positions past the block table.
    topk_idx = torch.randint(-4, width * bs * 2 + 40, (tokens, topk), generator=g, dtype=torch.int32)
    topk_idx[torch.rand(tokens, topk, generator=g) < 0.05] = -(2**31)
    return table, req_id, topk_idx


@given(seed=seeds, tokens=st.integers(0, 8), topk=st.integers(1, 70), bs=st.sampled_from([16, 64]),
       stride=st.sampled_from([None, 67]), with_prefill=st.booleans(), counts=st.booleans())
def test_convert_index_is_exact(seed, tokens, topk, bs, stride, with_prefill, counts):
    g = torch.Generator().manual_seed(seed)
    table, req_id, topk_idx = random_conversion_inputs(g, tokens, topk, bs)
    pids = starts = None
    if with_prefill:
        pids = torch.randint(-1, 2, (tokens,), generator=g, dtype=torch.int32)
        starts = torch.tensor([0, 1000], dtype=torch.int32)
    with buffers.poisoned():
        got = E.convert_index(req_id=req_id, block_table=table, topk_indices=topk_idx, block_size=bs,
                              block_stride_rows=stride, prefill_request_ids=pids, prefill_workspace_starts=starts,
                              return_valid_counts=counts)
    want = R.convert_index(req_id, table, topk_idx, bs, stride, pids, starts, counts)
    for a, b in zip(got, want) if counts else [(got, want)]:
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b)


@given(seed=seeds, tokens=st.integers(0, 8), topk=st.integers(1, 70), dcp=st.sampled_from([1, 2, 4, 8]),
       interleave=st.sampled_from([1, 2, 16]), compact=st.booleans(), data=st.data())
def test_dcp_convert_index_is_exact(seed, tokens, topk, dcp, interleave, compact, data):
    g = torch.Generator().manual_seed(seed)
    rank = data.draw(st.integers(0, dcp - 1))
    table, req_id, topk_idx = random_conversion_inputs(g, tokens, topk, 16)
    with buffers.poisoned():
        got = E.dcp_convert_index(req_id=req_id, block_table=table, topk_indices=topk_idx, block_size=16,
                                  dcp_size=dcp, dcp_rank=rank, interleave=interleave, compact_valid_to_front=compact)
    assert torch.equal(got, R.dcp_convert_index(req_id, table, topk_idx, 16, dcp, rank, interleave, compact))


@given(seed=seeds, tokens=st.integers(1, 6), heads=st.sampled_from([1, 16, 64]), topk=st.sampled_from([1, 16, 64]),
       n_kv=st.integers(1, 80), regime=st.sampled_from(REGIMES), sink=st.sampled_from([None, "finite", "inf"]),
       lengths=st.booleans())
def test_sparse_prefill_with_sinks_lengths_and_invalid_entries(seed, tokens, heads, topk, n_kv, regime, sink, lengths):
    g = torch.Generator().manual_seed(seed)
    q = q_values(g, (tokens, heads, 576), regime)
    kv = kv_values(g, n_kv, regime)
    # In-range rows (duplicates likely), negatives, rows >= N; some rows all invalid.
    idx = torch.randint(-3, n_kv + 3, (tokens, topk), generator=g, dtype=torch.int32)
    idx[torch.rand(tokens, generator=g) < 0.2] = -1
    topk_length = torch.randint(0, topk + 1, (tokens,), generator=g, dtype=torch.int32) if lengths else None
    attn_sink = None
    if sink is not None:
        attn_sink = torch.randn(heads, generator=g) * 3
        if sink == "inf":
            attn_sink[::2] = -math.inf  # no effect
            attn_sink[1::4] = math.inf  # output exactly 0
    with buffers.poisoned():
        out, lse, max_logits = E.sparse_prefill(q=q, kv=kv, indices=idx, sm_scale=0.1, topk_length=topk_length,
                                                attn_sink=attn_sink)
    ref = R.sparse_prefill(q, kv, idx, 0.1, topk_length=topk_length, attn_sink=attn_sink)
    model = ErrorModel(q, [kv[None]], "bfloat16", 0.1, topk)
    check_against_reference(out, lse, ref.out, ref.lse, model)
    assert torch.equal(max_logits == -math.inf, ref.max_logits == -math.inf)
    live = ref.lse.isfinite()
    assert bool(((max_logits.double() - ref.max_logits).abs() <= model.max_logits())[live].all())


@given(seed=seeds, ranks=st.sampled_from([1, 2, 4, 8]), tokens=st.integers(1, 5))
def test_dcp_merge_matches_and_never_lets_junk_through(seed, ranks, tokens):
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(ranks, tokens, 8, 32, generator=g).to(torch.bfloat16)
    lses = torch.randn(ranks, tokens, 8, generator=g) * 4
    junk = torch.rand(ranks, tokens, 8, generator=g)
    lses[junk < 0.1] = -math.inf   # neutralized: (0, -inf) from the pipeline, here with junk outputs
    lses[(junk >= 0.1) & (junk < 0.15)] = math.inf
    lses[(junk >= 0.15) & (junk < 0.2)] = math.nan
    outs[junk[..., None].expand_as(outs) < 0.2] = math.nan
    with buffers.poisoned():
        out, lse = E.dcp_merge(outs=outs, lses=lses)
    want_out, want_lse = R.dcp_merge(outs, lses)
    assert not bool(out.isnan().any()) and not bool(lse.isnan().any())
    assert torch.equal(lse == -math.inf, want_lse == -math.inf)
    live = want_lse.isfinite()
    # Both round each term to bf16 from weights that differ by fp32 error (bounds section 3).
    tol_out, tol_lse = fp32_merge_bounds(outs, lses, want_out, want_lse)
    assert bool(((out.double() - want_out).abs() <= tol_out).all())
    assert bool(((lse.double() - want_lse).abs() <= tol_lse)[live].all())
    # The merge is the sum of every rank's own correction (what the reduce-scatter adds up).
    with buffers.poisoned():
        shares = [E.dcp_lse_correct(out_r=outs[r], lses=lses, rank=r) for r in range(ranks)]
    assert all(same_bits(share_lse, lse) for _, share_lse in shares)
    assert same_bits(torch.stack([p for p, _ in shares]).float().sum(0).to(torch.bfloat16), out)


@given(seed=seeds, tokens=st.integers(0, 6), heads=st.sampled_from([1, 16]))
def test_query_concat_and_spec_decode_views_are_exact(seed, tokens, heads):
    q = q_values(torch.Generator().manual_seed(seed), (tokens, heads, 576), "normal")
    with buffers.poisoned():
        got = E.concat_mla_q(ql_nope=q[..., :512], q_pe=q[..., 512:])
    assert same_bits(got, R.concat_mla_q(q[..., :512], q[..., 512:]))
    if tokens % 2 == 0 and tokens:
        spec = spec_decode.reshape_query_for_spec_decode(q=q, num_decodes=tokens // 2)
        assert spec.data_ptr() == q.data_ptr() and torch.equal(spec, R.reshape_query_for_spec_decode(q, tokens // 2))
        back = spec_decode.reshape_attn_output_for_spec_decode(out=spec)
        assert back.data_ptr() == q.data_ptr() and torch.equal(back, q)


def _cache(n_blocks=2, bs=4):
    return torch.zeros(n_blocks, bs, 656, dtype=torch.uint8)


REJECTED = {
    "decode index other than -1": lambda: E.sparse_decode_fp8(
        q=torch.zeros(1, 1, 64, 576, dtype=torch.bfloat16), kv_cache=_cache(),
        indices=torch.tensor([[[0, -2]]], dtype=torch.int32), sm_scale=0.1),
    "decode index past the cache": lambda: E.sparse_decode_fp8(
        q=torch.zeros(1, 1, 64, 576, dtype=torch.bfloat16), kv_cache=_cache(),
        indices=torch.tensor([[[8]]], dtype=torch.int32), sm_scale=0.1),
    "req_id longer than the index rows": lambda: E.convert_index(
        req_id=torch.zeros(5, dtype=torch.int32), block_table=torch.zeros(1, 1, dtype=torch.int32),
        topk_indices=torch.zeros(3, 8, dtype=torch.int32), block_size=64),
    "req_id past the block table": lambda: E.convert_index(
        req_id=torch.ones(3, dtype=torch.int32), block_table=torch.zeros(1, 1, dtype=torch.int32),
        topk_indices=torch.zeros(3, 8, dtype=torch.int32), block_size=64),
    "topk_length past the row": lambda: E.sparse_prefill(
        q=torch.zeros(1, 64, 576, dtype=torch.bfloat16), kv=torch.zeros(4, 576, dtype=torch.bfloat16),
        indices=torch.zeros(1, 8, dtype=torch.int32), sm_scale=0.1, topk_length=torch.tensor([9], dtype=torch.int32)),
    "float32 query": lambda: E.sparse_prefill(
        q=torch.zeros(1, 64, 576), kv=torch.zeros(4, 576, dtype=torch.bfloat16),
        indices=torch.zeros(1, 8, dtype=torch.int32), sm_scale=0.1),
    "non-positive sm_scale": lambda: E.sparse_prefill(
        q=torch.zeros(1, 64, 576, dtype=torch.bfloat16), kv=torch.zeros(4, 576, dtype=torch.bfloat16),
        indices=torch.zeros(1, 8, dtype=torch.int32), sm_scale=0.0),
    "workspace past the block table": lambda: E.gather_upconvert_fp8(
        kv_cache=_cache(), block_table=torch.zeros(1, 1, dtype=torch.int32),
        workspace_starts=torch.zeros(1, dtype=torch.int32), num_rows=5),
    "descending workspace starts": lambda: E.gather_upconvert_fp8(
        kv_cache=_cache(), block_table=torch.zeros(2, 2, dtype=torch.int32),
        workspace_starts=torch.tensor([0, -1], dtype=torch.int32), num_rows=2),
    "block id past the cache": lambda: E.gather_upconvert_fp8(
        kv_cache=_cache(), block_table=torch.full((1, 1), 2, dtype=torch.int32),
        workspace_starts=torch.zeros(1, dtype=torch.int32), num_rows=1),
    "slot past the cache": lambda: E.write_fp8_ds_mla_cache(
        kv=torch.zeros(1, 576, dtype=torch.bfloat16), kv_cache=_cache(), slot_mapping=torch.tensor([8])),
    "interleave not dividing the block": lambda: E.dcp_convert_index(
        req_id=torch.zeros(1, dtype=torch.int32), block_table=torch.zeros(1, 1, dtype=torch.int32),
        topk_indices=torch.zeros(1, 8, dtype=torch.int32), block_size=64, dcp_size=2, dcp_rank=0,
        interleave=3, compact_valid_to_front=False),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_invalid_inputs_are_rejected_before_any_work(case):
    with pytest.raises(InputError):
        REJECTED[case]()
