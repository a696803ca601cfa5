"""The sparse attention kernels (Triton; FlashMLA on a GPU) against the float64 reference.

Each kernel output is held element by element to the bound derived from the arithmetic the kernel
does (`mla_verify.equivalence.bounds`, section 1: bf16 P, fp32 accumulation, the bf16 output
rounding, subnormal floors, the rows' own rounding from non-power-of-two scales), so a pass means
"within what fp32/bf16 arithmetic can explain" and not "close enough". u = 2^-24 under the
interpreter (IEEE fp32 dots); 2^-23 on a GPU. Exact contracts (empty rows, +-inf / NaN patterns,
a single valid index) are compared exactly. Every failure message carries the error in units of
the reference's own bf16 rounding, ||out - ref|| / ||bf16(ref) - ref||.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from hypothesis import given, strategies as st

from mla_verify import reference as R
from mla_verify.equivalence.bounds import DEQUANT_REL, weighted_abs_values
from mla_verify.equivalence.values import kv_values, q_values
from mla_verify.optimized import buffers, flashmla, registry
from mla_verify.optimized.kernels import sparse_decode as triton_decode
from mla_verify.optimized.kernels import sparse_prefill as triton_prefill
from mla_verify.optimized.kernels.attention_launch import VARIANTS, AttentionConfig
from mla_verify.optimized.validation import InputError
from tests.bound_checks import check_attention

SEEDS = st.integers(0, 2**31 - 1)
HEADS = st.sampled_from([1, 8, 16, 64])
REGIMES = st.sampled_from(["normal", "outliers", "peaked", "tiny"])
SM_SCALES = st.sampled_from([576**-0.5, 0.5, 0.1352])  # FlashMLA's tests, and DeepSeek's 192^-0.5 * mscale^2
OUT_OF_RANGE_NEGATIVES = (-2, -7, -123456, -(2**31))
# The launch switches that change the kernel's code (addressing, the L2 prefetch of a later
# block): the interpreter skips the prefetch itself but runs the index and address arithmetic.
LEAN = st.booleans()
PREFETCH = st.sampled_from([0, 2])


# ---------------------------------------------------------------------------------------------
# Prefill


def prefill_inputs(seed, tokens, heads, rows, topk, invalid, length_mode, sink_mode, regime, strided):
    """q, kv (unreferenced rows NaN), indices, topk_length, attn_sink from one seed."""
    g = torch.Generator().manual_seed(seed)
    q = q_values(g, (tokens, heads + 3 * strided, 576), regime)[:, :heads]
    kv = kv_values(g, rows, regime)
    if strided:  # rows further apart than 576 elements
        kv = torch.cat([kv, torch.zeros(rows, 64, dtype=torch.bfloat16)], dim=1)[:, :576]
    idx = torch.randint(0, rows, (tokens, topk), generator=g, dtype=torch.int32)
    bad = torch.tensor([-1, *OUT_OF_RANGE_NEGATIVES, rows, rows + 5, 2**31 - 1], dtype=torch.int32)
    pick = lambda shape: bad[torch.randint(0, len(bad), shape, generator=g)]  # noqa: E731
    if invalid == "tail":
        cut = int(torch.randint(0, topk + 1, (1,), generator=g))
        idx[:, cut:] = pick((tokens, topk - cut))
    elif invalid == "scattered":
        mask = torch.rand(tokens, topk, generator=g) < 0.3
        idx[mask] = pick((int(mask.sum()),))
    elif invalid == "whole_row":
        idx[int(torch.randint(0, tokens, (1,), generator=g))] = int(pick((1,)))
    elif invalid == "duplicates":
        idx[:, 1::2] = idx[:, : topk // 2]
    length = {
        None: None,
        "zero": torch.zeros(tokens, dtype=torch.int32),
        "one": torch.ones(tokens, dtype=torch.int32),
        "full": torch.full((tokens,), topk, dtype=torch.int32),
        "random": torch.randint(0, topk + 1, (tokens,), generator=g, dtype=torch.int32),
    }[length_mode]
    sink = {
        None: None,
        "-inf": torch.full((heads,), -math.inf),
        "+inf": torch.full((heads,), math.inf),
        "finite": torch.randn(heads, generator=g) * 3,
        "mixed": torch.tensor([-math.inf, math.inf, 0.5])[torch.randint(0, 3, (heads,), generator=g)],
    }[sink_mode]
    valid = (idx >= 0) & (idx < rows)
    if length is not None:
        valid &= torch.arange(topk)[None, :] < length[:, None]
    unreferenced = torch.ones(rows, dtype=torch.bool)
    unreferenced[idx[valid].long()] = False
    kv[unreferenced] = float("nan")
    return q, kv, idx, length, sink, valid


@given(
    seed=SEEDS,
    tokens=st.integers(1, 3),
    heads=HEADS,
    rows=st.integers(1, 300),
    topk=st.integers(16, 256),
    invalid=st.sampled_from([None, "tail", "scattered", "whole_row", "duplicates"]),
    length_mode=st.sampled_from([None, "zero", "one", "full", "random"]),
    sink_mode=st.sampled_from([None, "-inf", "+inf", "finite", "mixed"]),
    regime=REGIMES,
    sm_scale=SM_SCALES,
    strided=st.booleans(),
    lean=LEAN,
    prefetch=PREFETCH,
)
def test_triton_prefill_matches_reference(
    seed, tokens, heads, rows, topk, invalid, length_mode, sink_mode, regime, sm_scale, strided, lean, prefetch
):
    q, kv, idx, length, sink, valid = prefill_inputs(
        seed, tokens, heads, rows, topk, invalid, length_mode, sink_mode, regime, strided
    )
    config = AttentionConfig(lean_addressing=lean, l2_prefetch=prefetch)
    with buffers.poisoned():
        got = triton_prefill.sparse_prefill(q, kv, idx, sm_scale, length, sink, config=config)
    ref = R.sparse_prefill(q, kv, idx, sm_scale, topk_length=length, attn_sink=sink)
    ab = weighted_abs_values(q, kv[torch.where(valid, idx, 0).long()], valid, sm_scale, ref.lse, sink)
    check_attention("triton prefill", got, ref, ab, topk)


def test_triton_prefill_single_valid_index_returns_that_row_exactly():
    """With one valid entry p = 2^0 = 1 exactly, so out is the bf16 row itself and lse = max logit."""
    g = torch.Generator().manual_seed(11)
    q, kv = q_values(g, (3, 16, 576), "normal"), kv_values(g, 40, "normal")
    idx = torch.full((3, 100), -1, dtype=torch.int32)
    idx[torch.arange(3), torch.tensor([0, 57, 99])] = torch.tensor([5, 39, 0], dtype=torch.int32)
    with buffers.poisoned():
        out, lse, max_logits = triton_prefill.sparse_prefill(q, kv, idx, 0.1)
    assert torch.equal(out, kv[[5, 39, 0], None, :512].expand(3, 16, 512))
    assert torch.equal(lse, max_logits)


# ---------------------------------------------------------------------------------------------
# Decode


def decode_inputs(seed, batch, s_q, heads, topk, page, pad, invalid, rule, regime):
    """q, a paged fp8_ds_mla cache (unreferenced slots and padding rows all 0xFF = NaN), indices."""
    g = torch.Generator().manual_seed(seed)
    blocks = 1 + -(-48 // page) + int(torch.randint(0, 3, (1,), generator=g))
    slots = blocks * page
    q = q_values(g, (batch, s_q, heads, 576), regime)
    idx = torch.randint(0, slots, (batch, s_q, topk), generator=g, dtype=torch.int32)
    if invalid == "tail":
        cut = int(torch.randint(0, topk + 1, (1,), generator=g))
        idx[..., cut:] = -1
    elif invalid == "scattered":
        idx[torch.rand(batch, s_q, topk, generator=g) < 0.3] = -1
    elif invalid == "whole_row":
        idx[int(torch.randint(0, batch, (1,), generator=g)), int(torch.randint(0, s_q, (1,), generator=g))] = -1
    elif invalid == "duplicates":
        idx[..., 1::2] = idx[..., : topk // 2]
    storage = torch.full((blocks, page + pad, 656), 0xFF, dtype=torch.uint8)
    cache = storage[:, :page]
    referenced = idx[idx >= 0].long().unique()
    R.write_fp8_ds_mla_cache(kv_values(g, len(referenced), regime), cache, referenced, rule)
    return q, cache, idx


def decode_check_inputs(q, cache, idx, sm_scale, got, ref):
    """A decode case flattened to [B*S, H(, 512)] for `check_attention`: (got, ref, ab)."""
    batch, s_q, heads, _ = q.shape
    valid = (idx != -1).reshape(batch * s_q, -1)
    slots = torch.where(valid, idx.reshape(batch * s_q, -1), 0).long()
    rows = R.fp8_ds_mla_values(cache[slots // cache.shape[1], slots % cache.shape[1]])
    flat = lambda x: x.transpose(1, 2).reshape(batch * s_q, heads)  # noqa: E731  [B,H,S] -> [B*S,H]
    lse = flat(ref.lse)
    ab = weighted_abs_values(q.reshape(batch * s_q, heads, 576), rows, valid, sm_scale, lse, None)
    out, got_lse = got
    assert out.shape == ref.out.shape and got_lse.shape == ref.lse.shape
    got = (out.reshape(batch * s_q, heads, 512), flat(got_lse), None)
    return got, (ref.out.reshape(batch * s_q, heads, 512), lse, None, flat(ref.logit_l1)), ab


@given(
    seed=SEEDS,
    batch=st.integers(1, 2),
    s_q=st.integers(1, 2),
    heads=HEADS,
    topk=st.integers(16, 256),
    page=st.sampled_from([1, 16, 64, 69]),
    pad=st.sampled_from([0, 1]),
    invalid=st.sampled_from([None, "tail", "scattered", "whole_row", "duplicates"]),
    rule=st.sampled_from(["pow2", "pow2", "raw"]),
    regime=REGIMES,
    sm_scale=SM_SCALES,
    splits=st.sampled_from([None, 1, 3]),
    lean=LEAN,
    prefetch=PREFETCH,
)
def test_triton_decode_matches_reference(
    seed, batch, s_q, heads, topk, page, pad, invalid, rule, regime, sm_scale, splits, lean, prefetch
):
    q, cache, idx = decode_inputs(seed, batch, s_q, heads, topk, page, pad, invalid, rule, regime)
    config = AttentionConfig(num_splits=splits, lean_addressing=lean, l2_prefetch=prefetch)
    with buffers.poisoned():
        got = triton_decode.sparse_decode_fp8(q, cache, idx, sm_scale, config=config)
    ref = R.sparse_decode_fp8(q, cache, idx, sm_scale)
    dequant_rel = DEQUANT_REL["bf16_dequant"] if rule == "raw" else 0.0  # the Triton decode's deviation
    check_attention(f"triton decode ({rule} scales)", *decode_check_inputs(q, cache, idx, sm_scale, got, ref),
                    topk, dequant_rel)


# ---------------------------------------------------------------------------------------------
# Validation before launch (CPU; the FlashMLA wrappers validate before importing flash_mla)


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("kernel launched despite invalid inputs")


@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr(triton_prefill, "_sparse_prefill_kernel", _NoLaunch())
    monkeypatch.setattr(triton_decode, "_sparse_decode_kernel", _NoLaunch())
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # importing it now raises ImportError


def _decode_args(bad_index=None):
    q = torch.zeros(1, 1, 64, 576, dtype=torch.bfloat16)
    cache = torch.zeros(2, 64, 656, dtype=torch.uint8)
    idx = torch.zeros(1, 1, 64, dtype=torch.int32)
    if bad_index is not None:
        idx[0, 0, 17] = bad_index
    return q, cache, idx


DECODE_IMPLS = [triton_decode.sparse_decode_fp8, flashmla.sparse_decode_fp8]
PREFILL_IMPLS = [triton_prefill.sparse_prefill, flashmla.sparse_prefill]


@pytest.mark.parametrize("impl", DECODE_IMPLS, ids=["triton", "flash_mla"])
@pytest.mark.parametrize("bad", [128, 2**31 - 1, -2, -(2**31)])
def test_decode_refuses_out_of_range_index_before_launch(no_launch, impl, bad):
    with pytest.raises(InputError, match=rf"indices: entry \(0, 0, 17\) is {bad}, outside \[0, 128\) or -1"):
        impl(*_decode_args(bad), 0.1)


@pytest.mark.parametrize("impl", DECODE_IMPLS, ids=["triton", "flash_mla"])
def test_decode_refuses_wrong_dtype_and_noncontiguous_rows(no_launch, impl):
    q, cache, idx = _decode_args()
    with pytest.raises(InputError, match="q: expected dtype bfloat16, got float32"):
        impl(q.float(), cache, idx, 0.1)
    with pytest.raises(InputError, match="indices: expected dtype int32, got int64"):
        impl(q, cache, idx.long(), 0.1)
    wide = torch.zeros(1, 1, 64, 1152, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="q: last dim must be contiguous"):
        impl(wide[..., ::2], cache, idx, 0.1)
    loose = torch.zeros(2, 64, 700, dtype=torch.uint8)[..., :656]
    with pytest.raises(InputError, match=r"stride\(1\) == 656"):
        impl(q, loose, idx, 0.1)


@pytest.mark.parametrize("impl", PREFILL_IMPLS, ids=["triton", "flash_mla"])
def test_prefill_refuses_wrong_dtype_noncontiguous_and_bad_scale(no_launch, impl):
    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    kv = torch.zeros(10, 576, dtype=torch.bfloat16)
    idx = torch.zeros(2, 128, dtype=torch.int32)
    with pytest.raises(InputError, match="kv: expected dtype bfloat16, got float16"):
        impl(q, kv.half(), idx, 0.1)
    with pytest.raises(InputError, match="q: last dim must be contiguous"):
        impl(torch.zeros(2, 64, 1152, dtype=torch.bfloat16)[..., ::2], kv, idx, 0.1)
    with pytest.raises(InputError, match="sm_scale: must be finite and > 0"):
        impl(q, kv, idx, -0.1)
    with pytest.raises(InputError, match=r"indices: expected shape \(2, '\*'\), got \(1, 128\)"):
        impl(q, kv, idx[:1], 0.1)


def test_flash_mla_wrappers_refuse_what_the_kernels_cannot_run(no_launch):
    kv = torch.zeros(10, 576, dtype=torch.bfloat16)
    q, idx = torch.zeros(2, 64, 576, dtype=torch.bfloat16), torch.zeros(2, 128, dtype=torch.int32)
    with pytest.raises(InputError, match="topk=192 must be a multiple of 128"):
        flashmla.sparse_prefill(q, kv, torch.zeros(2, 192, dtype=torch.int32), 0.1)
    with pytest.raises(InputError, match="heads=129"):
        flashmla.sparse_prefill(torch.zeros(2, 129, 576, dtype=torch.bfloat16), kv, idx, 0.1)
    with pytest.raises(InputError, match=r"topk_length: entry \(1,\) is 129"):
        flashmla.sparse_prefill(q, kv, idx, 0.1, topk_length=torch.tensor([0, 129], dtype=torch.int32))
    q, cache, _ = _decode_args()
    with pytest.raises(InputError, match="topk=96 must be a multiple of 64"):
        flashmla.sparse_decode_fp8(q, cache, torch.zeros(1, 1, 96, dtype=torch.int32), 0.1)
    # Valid inputs on CPU: refused for the device, still without importing flash_mla.
    with pytest.raises(InputError, match="FlashMLA runs on CUDA tensors"):
        flashmla.sparse_decode_fp8(*_decode_args(), 0.1)


def test_both_stages_register_triton_and_flash_mla():
    for stage, deviations in (("sparse_prefill", {"triton": ("loop_bound",), "flash_mla": ()}),
                              ("sparse_decode_fp8", {"triton": ("bf16_dequant", "split_kv"),
                                                     "flash_mla": ("bf16_cache_scale", "bf16_dequant", "split_kv")})):
        impls = {i.name: i for i in registry.implementations(stage)}
        assert {n: impls[n].deviations for n in deviations} == deviations
        assert impls["triton"].devices == {"cpu", "cuda"} and impls["flash_mla"].devices == {"cuda"}


# ---------------------------------------------------------------------------------------------
# GPU: compiled Triton and FlashMLA at production shapes


def _implementation(stage: str, name: str):
    impl = next(i for i in registry.implementations(stage) if i.name == name)
    reason = impl.why_not("cuda")
    if reason is not None:
        print(f"skip {stage}/{name}: {reason}")
        pytest.skip(f"{name}: {reason}")
    return impl.fn


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton", "flash_mla"])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_gpu_prefill_matches_reference(name, heads):
    fn = _implementation("sparse_prefill", name)
    g = torch.Generator().manual_seed(heads)
    tokens, rows, topk, sm_scale = 48, 6000, 2048, 0.1352
    q = q_values(g, (tokens, heads, 576), "normal").cuda()
    kv = kv_values(g, rows, "normal").cuda()
    idx = torch.randint(-64, rows + 64, (tokens, topk), generator=g, dtype=torch.int32).cuda()
    length = torch.randint(0, topk + 1, (tokens,), generator=g, dtype=torch.int32).cuda()
    length[:3] = torch.tensor([0, 1, topk], dtype=torch.int32)
    sink = torch.randn(heads, generator=g).cuda()
    got = fn(q, kv, idx, sm_scale, length, sink)
    ref = R.sparse_prefill(q, kv, idx, sm_scale, topk_length=length, attn_sink=sink)
    valid = (idx >= 0) & (idx < rows) & (torch.arange(topk, device="cuda")[None, :] < length[:, None])
    ab = weighted_abs_values(q, kv[torch.where(valid, idx, 0).long()], valid, sm_scale, ref.lse, sink)
    check_attention(f"{name} prefill H={heads}", got, ref, ab, topk)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton", "flash_mla"])
@pytest.mark.parametrize("batch,s_q,heads", [(1, 1, 128), (4, 2, 128), (64, 2, 64), (3, 1, 16)])
def test_gpu_decode_matches_reference(name, batch, s_q, heads):
    fn = _implementation("sparse_decode_fp8", name)
    q, cache, idx = decode_inputs(batch * 100 + heads, batch, s_q, heads, 2048, 64, 1, "scattered", "pow2", "normal")
    q, cache, idx = q.cuda(), cache.cuda(), idx.cuda()
    got = fn(q, cache, idx, 0.1352)
    ref = R.sparse_decode_fp8(q, cache, idx, 0.1352)
    check_attention(f"{name} decode B={batch} S={s_q} H={heads}",
                    *decode_check_inputs(q, cache, idx, 0.1352, got, ref), 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(VARIANTS["prefill"]))
def test_gpu_triton_prefill_variants_agree_with_reference(name):
    """Every prefill launch variant the sweep times, compiled, at production top-k."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(3)
    q, kv = q_values(g, (16, 128, 576), "normal").cuda(), kv_values(g, 3000, "normal").cuda()
    idx = torch.randint(-8, 3008, (16, 2048), generator=g, dtype=torch.int32).cuda()
    got = triton_prefill.sparse_prefill(q, kv, idx, 0.1, config=VARIANTS["prefill"][name])
    ref = R.sparse_prefill(q, kv, idx, 0.1)
    valid = (idx >= 0) & (idx < 3000)
    ab = weighted_abs_values(q, kv[torch.where(valid, idx, 0).long()], valid, 0.1, ref.lse, None)
    check_attention(f"triton prefill [{name}]", got, ref, ab, 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(VARIANTS["decode"]))
@pytest.mark.parametrize("pad", [0, 1], ids=["packed", "padded"])
def test_gpu_triton_decode_variants_agree_with_reference(name, pad):
    """Every decode launch variant the sweep times, compiled, on a packed cache (the layout lean
    addressing specializes) and a padded one."""
    q, cache, idx = decode_inputs(7, 3, 2, 128, 2048, 64, pad, "scattered", "pow2", "normal")
    q, cache, idx = q.cuda(), cache.cuda(), idx.cuda()
    got = triton_decode.sparse_decode_fp8(q, cache, idx, 0.1352, config=VARIANTS["decode"][name])
    ref = R.sparse_decode_fp8(q, cache, idx, 0.1352)
    check_attention(f"triton decode [{name}]", *decode_check_inputs(q, cache, idx, 0.1352, got, ref), 2048)
