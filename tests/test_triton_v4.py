"""Our DeepSeek V4 / V4.1 Triton kernels (and FlashMLA's V4 decode on a GPU) against the reference:
the cache writers and index builders bit for bit, the union decode element by element within the
bound derived from its arithmetic (`mla_verify.equivalence.bounds`), the contract checks before
any launch."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mla_verify import reference as R
from mla_verify.optimized import buffers, flashmla_v4
from mla_verify.optimized.kernels import union_decode, v4_cache_writer, v4_indices
from mla_verify.optimized.kernels.attention_launch import AttentionConfig
from mla_verify.optimized.v4_checks import V41_PAIRS, V4_PAIRS, ListArgs
from mla_verify.optimized.validation import InputError
from tests.bound_checks import check_attention
from tests.v4_inputs import decode_case

SEEDS = st.integers(0, 2**31 - 1)
PAIRS = st.sampled_from([("V4", "V4"), ("V4", None), ("V41", "V41_FP4"), ("V41", "V41"), ("V41", None)])
LENGTHS = st.sampled_from(["none", "random", "edges"])


def _decode(kw, fmt, config):
    """Our Triton union decode of `fmt`'s op on contract keywords `kw`, launched with `config`."""
    pairs = V4_PAIRS if fmt == "V4" else V41_PAIRS
    return union_decode.decode_checked(kw["q"], ListArgs(kw["kv_cache"], kw["indices"], kw["topk_length"]),
                                       ListArgs(kw["extra_kv_cache"], kw["extra_indices"], kw["extra_topk_length"]),
                                       kw["sm_scale"], kw["attn_sink"], pairs, config)


def reference_of(kw):
    """The reference's answer with its magnitudes (the derived bounds' inputs)."""
    main, extra = R.lists_of(kw)
    return R.sparse_decode_union(kw["q"], main, kw["sm_scale"], extra, kw["attn_sink"], magnitudes=True)


def union_check_inputs(q, got, ref):
    """A union decode flattened to [B*S, H(, 512)] for `check_attention`: (got, ref, ab)."""
    batch, s_q, heads, _ = q.shape
    flat = lambda x: x.transpose(1, 2).reshape(batch * s_q, heads)  # noqa: E731  [B,H,S] -> [B*S,H]
    out, lse = got
    assert out.shape == ref.out.shape and lse.shape == ref.lse.shape
    ab = tuple(t.reshape(batch * s_q, heads, 512) for t in (ref.out_abs, ref.value_abs))
    return ((out.reshape(batch * s_q, heads, 512), flat(lse), None),
            (ref.out.reshape(batch * s_q, heads, 512), flat(ref.lse), None, flat(ref.logit_l1)), ab)


# ---------------------------------------------------------------------------------------------
# Cache writers: bit for bit


@settings(max_examples=6)
@given(seed=SEEDS, fmt=st.sampled_from(["V4", "V41", "V41_FP4"]), rule=st.sampled_from(v4_cache_writer.SCALE_RULES),
       block=st.sampled_from([1, 5, 64]))
def test_writers_match_the_reference_quantizer_byte_for_byte(seed, fmt, rule, block):
    g = torch.Generator().manual_seed(seed)
    n = 9
    kv = (torch.randn(n, 512, generator=g) * torch.logspace(-7, 4, n)[:, None]).bfloat16()
    kv[0, :70] = 0                      # zero tiles
    kv[1, 5] = float("nan")            # a NaN tile
    kv[2, 40:50] = -0.0                 # signed zeros
    kv[3, 300] = float("-inf")          # an infinite tile
    kv[4, :] = 2.0**-133                # bf16 subnormals
    blocks = -(-(n + 2) // block)
    slots = torch.randperm(blocks * block + 2, generator=g)[:n] - 2  # some negative: skipped
    got, want = R.allocate_cache(blocks, block, fmt), R.allocate_cache(blocks, block, fmt)
    writer = v4_cache_writer.write_v4_cache if fmt == "V4" else v4_cache_writer.write_v41_cache
    writer(kv, got, slots, rule)
    R.write_v4_cache(kv, want, slots, rule)
    assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"


def test_writer_refuses_a_cache_of_another_format():
    kv = torch.zeros(1, 512, dtype=torch.bfloat16)
    with pytest.raises(InputError, match=r"kv_cache: rows of 528 bytes; this op reads 584 \(V4\)"):
        v4_cache_writer.write_v4_cache(kv, R.allocate_cache(1, 4, "V41"), torch.zeros(1, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# Index builders: bit for bit


@settings(max_examples=6)
@given(seed=SEEDS, window=st.sampled_from([1, 4, 128]), block=st.sampled_from([1, 3, 64]),
       ratio=st.sampled_from([4, 128]))
def test_index_builders_match_the_reference(seed, window, block, ratio):
    g = torch.Generator().manual_seed(seed)
    reqs = 3
    seq = torch.randint(1, 400, (reqs,), generator=g)
    qlen = torch.minimum(torch.randint(1, 5, (reqs,), generator=g), seq)
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), qlen.cumsum(0)]) + 3  # rebased to its first entry
    gather = torch.minimum(seq, qlen + torch.randint(0, window, (reqs,), generator=g))
    topk, n = 16, 400 // ratio + 1
    picks = torch.randint(0, n, (int(qlen.sum()), 20), generator=g).int()
    args = (picks, qsl.int(), seq.int(), gather.int(), window, ratio, topk, 10_000, n)
    got, want = v4_indices.v4_prefill_indices(*args), R.v4_prefill_indices(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    table = torch.randperm(reqs * 400, generator=g).view(reqs, -1)[:, : -(-400 // block)].int().contiguous()
    req = torch.repeat_interleave(torch.arange(reqs), qlen)
    pos = seq[req] - qlen[req] + torch.cat([torch.arange(int(q)) for q in qlen])
    got, want = v4_indices.window_indices(pos, req, table, block, window), R.window_indices(pos, req, table, block, window)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    comp = torch.randint(-1, 1000, (pos.shape[0], 13), generator=g).int()
    lens = torch.randint(0, 14, (pos.shape[0],), generator=g).int()
    for counted in (lens, None):
        got = v4_indices.flashinfer_decode_table(want[0], comp, counted)
        ref = R.flashinfer_decode_table(want[0], comp, counted)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


# ---------------------------------------------------------------------------------------------
# Union decode: within the derived bound


@settings(max_examples=10)
@given(seed=SEEDS, pair=PAIRS, s_q=st.sampled_from([1, 4]), heads=st.sampled_from([1, 16]),
       topk=st.sampled_from([16, 64, 100]), extra_topk=st.sampled_from([8, 64, 100]), block=st.sampled_from([1, 5, 64]),
       lengths=LENGTHS, extra_lengths=LENGTHS, sink=st.sampled_from(["none", "finite", "inf"]),
       rule=st.sampled_from(["pow2", "pow2_amax"]), splits=st.sampled_from([None, 1, 3]))
def test_triton_union_decode_matches_reference(seed, pair, s_q, heads, topk, extra_topk, block, lengths, extra_lengths,
                                               sink, rule, splits):
    fmt, extra = pair
    kw = decode_case(seed, fmt=fmt, extra_fmt=extra, batch=2, s_q=s_q, heads=heads, topk=topk, extra_topk=extra_topk,
                     block=block, extra_block=block + 2, lengths=lengths, extra_lengths=extra_lengths, sink=sink,
                     scale_rule=rule, gap=16)
    with buffers.poisoned():
        got = _decode(kw, fmt, AttentionConfig(num_splits=splits))
    ref = reference_of(kw)
    check_attention(f"triton {fmt}+{extra} decode", *union_check_inputs(kw["q"], got, ref),
                    topk + (extra_topk if extra else 0))


# ---------------------------------------------------------------------------------------------
# The contract, checked before launch (the FlashMLA wrapper validates before importing flash_mla)


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("kernel launched despite invalid inputs")


@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr(union_decode, "_union_decode_kernel", _NoLaunch())
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # importing it now raises ImportError


IMPLS = [union_decode.sparse_decode_v4, flashmla_v4.sparse_decode_v4]


@pytest.mark.parametrize("impl", IMPLS, ids=["triton", "flash_mla"])
def test_the_contract_is_checked_before_launch(no_launch, impl):
    kw = decode_case(1, batch=2, s_q=1, heads=64, topk=64, extra_topk=64, block=64, extra_block=64,
                     lengths="none", extra_lengths="none", invalid_rate=0.0)
    bad = dict(kw, indices=kw["indices"].clone())
    bad["indices"][1, 0, 17] = 10**6
    with pytest.raises(InputError, match=r"indices: entry \(1, 0, 17\) is 1000000, outside \[0, 192\) or -1"):
        impl(**bad)
    with pytest.raises(InputError, match=r"extra_topk_length: entry \(0,\) is 65, outside \[0, 65\)"):
        impl(**dict(kw, extra_topk_length=torch.tensor([65, 0], dtype=torch.int32)))
    with pytest.raises(InputError, match="extra_kv_cache and extra_indices come together"):
        impl(**dict(kw, extra_indices=None, extra_topk_length=None))
    with pytest.raises(InputError, match=r"kv_cache: rows of 528 bytes; this op reads 584 \(V4\)"):
        impl(**dict(kw, kv_cache=R.allocate_cache(3, 64, "V41")))
    with pytest.raises(InputError, match=r"topk_length: expected shape \(2,\), got \(4,\)"):  # per token, not per request
        impl(**dict(kw, topk_length=torch.zeros(4, dtype=torch.int32)))
    past = dict(kw, topk_length=torch.tensor([17, 64], dtype=torch.int32), indices=kw["indices"].clone())
    past["indices"][0, 0, 20] = -5  # past request 0's length: never read, so never refused
    if impl is union_decode.sparse_decode_v4:
        with pytest.raises(AssertionError, match="kernel launched"):
            impl(**past)
    else:
        with pytest.raises(InputError, match="FlashMLA runs on CUDA tensors"):
            impl(**past)


def test_flash_mla_pads_lists_to_its_block_with_minus_one():
    idx = torch.arange(2 * 100, dtype=torch.int32).view(1, 2, 100)
    padded = flashmla_v4.padded_list(idx)
    assert padded.shape == (1, 2, 128) and torch.equal(padded[..., :100], idx) and bool((padded[..., 100:] == -1).all())
    assert flashmla_v4.padded_list(padded) is padded


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["flash_mla", "triton"])
@pytest.mark.parametrize("heads,s_q,batch", [(64, 1, 4), (128, 4, 2), (16, 2, 3)])
def test_v4_decode_on_gpu_matches_reference(impl, heads, s_q, batch):
    if impl == "flash_mla" and flashmla_v4.flash_mla_unavailable():
        pytest.skip(flashmla_v4.flash_mla_unavailable())
    kw = decode_case(heads + s_q, batch=batch, s_q=s_q, heads=heads, topk=128, extra_topk=512, block=64, extra_block=64,
                     lengths="random", extra_lengths="edges", sink="inf")
    kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    fn = flashmla_v4.sparse_decode_v4 if impl == "flash_mla" else union_decode.sparse_decode_v4
    with buffers.poisoned():
        got = fn(**kw)
    ref = reference_of(kw)
    check_attention(f"{impl} V4 decode H={heads}", *union_check_inputs(kw["q"], got, ref), 128 + 512)
