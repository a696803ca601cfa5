"""Self-checks of the reference attention against an independent dense formulation."""

import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, strategies as st

from mla_verify import reference as R
from mla_verify.reference.attention import row_build_bytes
from mla_verify.reference.streaming import MEMORY_ENV, chunk_tokens, token_bytes

seeds = st.integers(0, 2**31 - 1)


def dense_attention(q, kv, weights, sm_scale, sink=None, values=None):
    """Masked softmax over ALL kv rows, each row weighted by how often the index row selects it;
    averaging `values` (default the rows' NoPE part)."""
    s = sm_scale * torch.einsum("thd,nd->thn", q.double(), kv.double())
    w = weights.double()[:, None, :]
    lse = torch.log((w * torch.exp(s - s.amax(-1, keepdim=True))).sum(-1)) + s.amax(-1)
    values = kv.double()[:, :512] if values is None else values
    out = torch.einsum("thn,nd->thd", w * torch.exp(s - lse[..., None]), values)
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
    res = R.sparse_prefill(q, kv_poisoned[: rows + 3], idx, 0.07, topk_length=length, attn_sink=attn_sink,
                           magnitudes=True)
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
    # The magnitudes: the same softmax averaging |V|, and f * sum_j |V_j| (each selection counted)
    magnitude = kv.double()[:, :512].abs()
    out_abs, _ = dense_attention(q, kv, weights, 0.07, attn_sink, magnitude)
    factor = torch.ones(tokens, heads, dtype=torch.float64) if attn_sink is None else torch.sigmoid(lse - attn_sink.double())
    value_abs = (weights.double() @ magnitude)[:, None, :] * factor[..., None]
    assert torch.allclose(res.out_abs[live], out_abs[live], rtol=1e-12, atol=1e-12)
    assert torch.allclose(res.value_abs[live], value_abs[live], rtol=1e-12, atol=0)
    assert bool((res.out_abs[~live] == 0).all()) and bool((res.value_abs[~live] == 0).all())


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


def budget_for(tokens, heads, topk, build_bytes=2 * 576 + 64):
    """The smallest budget whose chunks hold `tokens` query tokens."""
    return -(-tokens * token_bytes(heads, topk, 8, build_bytes) * 16 // 15)


@pytest.fixture
def one_thread():
    """Chunking is exact in the reference's arithmetic, but a multithreaded float64 GEMM may split
    its work by the batch it is handed and by the threads free at that moment (MKL/OpenMP dynamic
    threads: seen failing bitwise only while other processes loaded the 2 cores), so the bitwise
    comparison runs on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("tokens_per_chunk", [1, 5])
def test_chunking_over_tokens_does_not_change_results(tokens_per_chunk, one_thread):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(37, 8, 576, generator=g).bfloat16()
    kv = torch.randn(300, 576, generator=g).bfloat16()
    idx = torch.randint(-1, 300, (37, 64), generator=g, dtype=torch.int32)
    length = torch.randint(0, 65, (37,), generator=g, dtype=torch.int32)
    sink = torch.randn(8, generator=g)
    whole = R.sparse_prefill(q, kv, idx, 0.1, length, sink, magnitudes=True)
    budget = budget_for(tokens_per_chunk, 8, 64)
    assert chunk_tokens(8, 64, 8, budget) == tokens_per_chunk
    chunked = R.sparse_prefill(q, kv, idx, 0.1, length, sink, budget_bytes=budget, magnitudes=True)
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)
    streamed = list(R.sparse_prefill_chunks(q, kv, idx, 0.1, length, sink, budget_bytes=budget, magnitudes=True))
    assert [rows.start for rows, _ in streamed] == list(range(0, 37, tokens_per_chunk))
    for rows, part in streamed:
        for a, b in zip(whole, part):
            assert torch.equal(a[rows], b)


def test_decode_chunking_does_not_change_results(one_thread):
    g = torch.Generator().manual_seed(4)
    kv = torch.randn(3 * 64, 576, generator=g).bfloat16()
    cache = torch.full((3, 64, 656), 0xFF, dtype=torch.uint8)  # NaN everywhere no index selects
    R.write_fp8_ds_mla_cache(kv, cache, torch.arange(3 * 64), "raw")
    q = torch.randn(3, 2, 16, 576, generator=g).bfloat16()
    idx = torch.randint(-1, 3 * 64, (3, 2, 128), generator=g, dtype=torch.int32)
    whole = R.sparse_decode_fp8(q, cache, idx, 0.1, magnitudes=True)
    budget = budget_for(1, 16, 128, row_build_bytes(cache, 8))
    assert chunk_tokens(16, 128, 8, budget, row_build_bytes(cache, 8)) == 1
    chunked = R.sparse_decode_fp8(q, cache, idx, 0.1, budget_bytes=budget, magnitudes=True)
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)
    assert not bool(whole.out.isnan().any())


def test_a_budget_below_one_token_is_refused_and_the_default_is_four_gib(monkeypatch):
    q, kv = torch.randn(2, 4, 576).bfloat16(), torch.randn(9, 576).bfloat16()
    idx = torch.zeros(2, 128, dtype=torch.int32)
    with pytest.raises(ValueError, match="holds no query token"):
        R.sparse_prefill(q, kv, idx, 0.1, budget_bytes=token_bytes(4, 128, 8))
    monkeypatch.delenv(MEMORY_ENV, raising=False)
    assert R.memory_budget() == 4 << 30
    monkeypatch.setenv(MEMORY_ENV, str(3 << 20))
    assert R.memory_budget() == 3 << 20
    with R.memory_limit(token_bytes(4, 128, 8)):
        assert R.memory_budget() == token_bytes(4, 128, 8)
        with pytest.raises(ValueError, match="holds no query token"):
            R.sparse_prefill(q, kv, idx, 0.1)
    assert R.memory_budget() == 3 << 20


@pytest.mark.parametrize("heads, topk", [(1, 64), (16, 512), (128, 2048)])
def test_the_chunk_plan_fills_the_budget_without_passing_it(heads, topk):
    for budget in (1 << 20, 64 << 20, 4 << 30):
        one = token_bytes(heads, topk, 8)
        if budget * 15 / 16 < one:
            continue
        chunk = chunk_tokens(heads, topk, 8, budget)
        assert chunk * one <= budget * 15 / 16 < (chunk + 1) * one
    # What one token holds grows with its K rows and logits: never below the rows themselves.
    assert token_bytes(heads, topk, 8) > topk * 576 * 8 + heads * topk * 8


_PEAK_PROBE = """
import sys, torch
from mla_verify import reference as R
torch.set_num_threads(1)
def rss(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field)) * 1024
form, budget = sys.argv[1], int(sys.argv[2])
g = torch.Generator().manual_seed(0)
q = torch.randn(64, 8, 576, generator=g).bfloat16()
kv = torch.randn(4096, 576, generator=g).bfloat16()
cache = R.quantize_fp8_ds_mla(kv).view(64, 64, 656)
idx = torch.randint(-1, 4096, (64, 512), generator=g, dtype=torch.int32)
def run(n):
    if form == "prefill":
        for _ in R.sparse_prefill_chunks(q[:n], kv, idx[:n], 0.1, budget_bytes=budget):
            pass
    elif form == "decode":
        for _ in R.sparse_decode_chunks(q[:n, None], cache, idx[:n, None], 0.1, budget_bytes=budget):
            pass
    else:
        return R.sparse_prefill(q[:n], kv, idx[:n], 0.1, budget_bytes=budget)
run(1)  # code pages and BLAS buffers resident before the measurement
open("/proc/self/clear_refs", "w").write("5")  # restart the peak-RSS counter
before = rss("VmRSS:")
run(64)
print(rss("VmHWM:") - before)
"""


@pytest.mark.parametrize("form", ["prefill", "decode", "whole"])
def test_working_memory_stays_within_the_budget(form):
    """Peak RSS of 64 tokens (8 heads, top-k 512: 224 MiB of K rows in float64) under a 16 MiB
    budget, measured in a fresh process with every large allocation its own mapping."""
    budget = 16 << 20
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _PEAK_PROBE, form, str(budget)], env=env,
                          capture_output=True, text=True, check=True)
    peak = int(done.stdout.split()[-1])
    result = 64 * 8 * (512 + 3) * 8 if form == "whole" else 0
    assert 0.5 * budget < peak <= budget + result


def test_on_a_full_gpu_the_chunks_shrink_to_its_headroom_and_wait_for_room(monkeypatch):
    """A part sharing a card (issue 48: four parts on an H100 ran out of their 9.9 GiB at the
    reference): the working budget is at most 7/8 of what the process may still allocate, and a call
    the headroom holds no token of waits for the other processes to give memory back."""
    from mla_verify.reference import streaming

    one = token_bytes(8, 64, 8)
    room = iter([0, 0, 40 * one])  # the card full twice, then room for 40 tokens
    monkeypatch.setattr(streaming, "device_headroom", lambda device: 10 * one)
    assert streaming.tokens_per_chunk(torch.device("cpu"), 8, 64, 8, 4 << 30, 2 * 576 + 64) == 8  # 7/8 of 10, less 1/16
    monkeypatch.setattr(streaming, "device_headroom", lambda device: next(room, 40 * one))
    monkeypatch.setattr(streaming, "WAIT_STEP_S", 0.0)
    assert streaming.tokens_per_chunk(torch.device("cpu"), 8, 64, 8, 4 << 30, 2 * 576 + 64) == 32
    monkeypatch.setattr(streaming, "device_headroom", lambda device: 0)  # never room: as an allocation would fail
    monkeypatch.setattr(streaming, "WAIT_S", 0.05)
    with pytest.raises(torch.OutOfMemoryError, match="no room for one query token"):
        streaming.tokens_per_chunk(torch.device("cpu"), 8, 64, 8, 4 << 30, 2 * 576 + 64)
    with pytest.raises(ValueError, match="holds no query token"):  # a budget too small itself: at once
        streaming.tokens_per_chunk(torch.device("cpu"), 8, 64, 8, one, 2 * 576 + 64)
