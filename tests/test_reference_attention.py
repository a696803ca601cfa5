"""Self-checks of the reference attention against an independent dense formulation."""

import math

import pytest
import torch
from hypothesis import given, strategies as st

from mla_verify import reference as R

seeds = st.integers(0, 2**31 - 1)


def dense_attention(q, kv, weights, sm_scale, sink=None):
    """Masked softmax over ALL kv rows, each row weighted by how often the index row selects it."""
    s = sm_scale * torch.einsum("thd,nd->thn", q.double(), kv.double())
    w = weights.double()[:, None, :]
    lse = torch.log((w * torch.exp(s - s.amax(-1, keepdim=True))).sum(-1)) + s.amax(-1)
    out = torch.einsum("thn,nd->thd", w * torch.exp(s - lse[..., None]), kv.double()[:, :512])
    if sink is not None:
        out = out * torch.sigmoid(lse - sink.double())[..., None]
    return out, lse


@given(
    seed=seeds,
    tokens=st.integers(1, 6),
    heads=st.sampled_from([1, 3, 16]),
    rows=st.integers(1, 50),
    topk=st.integers(1, 40),
    use_length=st.booleans(),
    sink=st.sampled_from([None, "finite", "-inf", "+inf"]),
)
def test_prefill_matches_dense_masked_softmax(seed, tokens, heads, rows, topk, use_length, sink):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, 576, generator=g).bfloat16()
    kv = torch.randn(rows, 576, generator=g).bfloat16()
    kv_poisoned = torch.cat([kv, torch.full((3, 576), float("nan"), dtype=torch.bfloat16)])
    idx = torch.randint(-5, rows + 3, (tokens, topk), generator=g, dtype=torch.int32)
    idx[idx >= rows] += 3  # out-of-range entries point past the NaN rows too: never read
    length = torch.randint(0, topk + 1, (tokens,), generator=g, dtype=torch.int32) if use_length else None
    attn_sink = None
    if sink is not None:
        attn_sink = {"finite": torch.randn(heads, generator=g), "-inf": torch.full((heads,), -math.inf),
                     "+inf": torch.full((heads,), math.inf)}[sink]
    res = R.sparse_prefill(q, kv_poisoned[: rows + 3], idx, 0.07, topk_length=length, attn_sink=attn_sink)
    weights = torch.zeros(tokens, rows)
    for t in range(tokens):
        for j in range(topk if length is None else int(length[t])):
            if 0 <= idx[t, j] < rows:
                weights[t, idx[t, j]] += 1
    out, lse = dense_attention(q, kv, weights, 0.07, attn_sink)
    live = weights.sum(1) > 0
    assert torch.allclose(res.lse[live], lse[live], rtol=0, atol=1e-12)
    assert torch.allclose(res.out[live], out[live], rtol=0, atol=1e-12)
    assert bool((res.lse[~live] == math.inf).all()) and bool((res.out[~live] == 0).all())
    assert bool((res.max_logits[~live] == -math.inf).all())
    assert not bool(torch.isnan(res.out).any())


def test_single_valid_index_returns_that_row():
    g = torch.Generator().manual_seed(7)
    q, kv = torch.randn(2, 4, 576, generator=g).bfloat16(), torch.randn(9, 576, generator=g).bfloat16()
    idx = torch.full((2, 128), -1, dtype=torch.int32)
    idx[:, 5] = torch.tensor([3, 8])
    res = R.sparse_prefill(q, kv, idx, 0.1)
    assert torch.equal(res.out[0], kv[3, :512].double().expand(4, 512))
    assert torch.equal(res.out[1], kv[8, :512].double().expand(4, 512))
    assert torch.allclose(res.lse, res.max_logits, atol=0, rtol=0)


@given(seed=seeds, batch=st.integers(1, 3), s_q=st.integers(1, 3), page=st.sampled_from([1, 5, 64]), topk=st.integers(1, 30), rule=st.sampled_from(["pow2", "raw"]))
def test_decode_equals_prefill_over_the_exactly_dequantized_rows(seed, batch, s_q, page, topk, rule):
    g = torch.Generator().manual_seed(seed)
    blocks = 4
    kv = torch.randn(blocks * page, 576, generator=g).bfloat16()
    storage = torch.empty(blocks, page + 1, 656, dtype=torch.uint8).fill_(0xFF)
    cache = storage[:, :page]
    R.write_fp8_ds_mla_cache(kv, cache, torch.arange(blocks * page), rule)
    q = torch.randn(batch, s_q, 16, 576, generator=g).bfloat16()
    idx = torch.randint(0, blocks * page, (batch, s_q, topk), generator=g, dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=g) < 0.3] = -1
    dec = R.sparse_decode_fp8(q, cache, idx, 0.05)
    values = R.fp8_ds_mla_values(cache.contiguous().view(-1, 656))
    pre = R.sparse_prefill(q.view(-1, 16, 576), values, idx.view(batch * s_q, topk), 0.05)
    assert torch.allclose(dec.out.reshape(-1, 16, 512), pre.out, atol=1e-12, rtol=0)
    assert torch.equal(dec.lse.transpose(1, 2).reshape(-1, 16).isinf(), pre.lse.isinf())
    finite = pre.lse.isfinite()
    assert torch.allclose(dec.lse.transpose(1, 2).reshape(-1, 16)[finite], pre.lse[finite], atol=1e-12, rtol=0)


def test_decode_refuses_indices_other_than_minus_one_out_of_range():
    cache = torch.zeros(2, 64, 656, dtype=torch.uint8)
    q = torch.randn(1, 1, 64, 576).bfloat16()
    for bad in (-2, 128, 2**31 - 1):
        idx = torch.tensor([[[0, -1, bad]]], dtype=torch.int32)
        with pytest.raises(ValueError, match="neither -1 nor a slot"):
            R.sparse_decode_fp8(q, cache, idx, 0.1)


def test_chunking_over_tokens_does_not_change_results():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(37, 8, 576, generator=g).bfloat16()
    kv = torch.randn(300, 576, generator=g).bfloat16()
    idx = torch.randint(-1, 300, (37, 64), generator=g, dtype=torch.int32)
    whole = R.sparse_prefill(q, kv, idx, 0.1)
    tiny = R.sparse_prefill(q, kv, idx, 0.1, budget_bytes=1)  # one token per chunk
    for a, b in zip(whole, tiny):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)
