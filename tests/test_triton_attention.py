"""The sparse attention kernels (Triton; FlashMLA on a GPU) against the float64 reference.

Each kernel output is held element by element to the bound derived from the arithmetic the kernel
does (`mla_verify.equivalence.judge.bounds`, section 1: bf16 P, fp32 accumulation, the bf16 output
rounding, subnormal floors, the rows' own rounding from non-power-of-two scales), so a pass means
"within what fp32/bf16 arithmetic can explain" and not "close enough". u = 2^-24 under the
interpreter (IEEE fp32 dots); 2^-23 on a GPU. Exact contracts (empty rows, +-inf / NaN patterns,
a single valid index) are compared exactly. Every failure message carries the error in units of
the reference's own bf16 rounding, ||out - ref|| / ||bf16(ref) - ref||.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, strategies as st

from mla_verify import reference as R
from mla_verify.equivalence import catalog
from mla_verify.equivalence.judge.bounds import DEQUANT_REL
from mla_verify.equivalence.cases.params import DECODE_PATTERNS
from mla_verify.equivalence.cases.patterns import PATTERNS
from mla_verify.equivalence.cases.values import REGIMES as VALUE_REGIMES, kv_values, q_values
from mla_verify.optimized import buffers, flashmla, registry
from mla_verify.optimized.kernels import sparse_decode as triton_decode
from mla_verify.optimized.kernels import sparse_prefill as triton_prefill
from mla_verify.optimized.kernels.attention_launch import VARIANTS, AttentionConfig
from mla_verify.optimized.validation import InputError
from tests.bound_checks import check_attention

SEEDS = st.integers(0, 2**31 - 1)
HEADS = st.sampled_from([1, 8, 16, 64])
REGIMES = st.sampled_from(VALUE_REGIMES)
SM_SCALES = st.sampled_from([576**-0.5, 0.5, 0.1352])  # FlashMLA's tests, and DeepSeek's 192^-0.5 * mscale^2
# The ops' params (equivalence.cases.params PrefillParams, DecodeParams): every invalid-index pattern each allows.
PREFILL_INVALID = st.lists(st.sampled_from(PATTERNS), max_size=3, unique=True)
DECODE_INVALID = st.lists(st.sampled_from(DECODE_PATTERNS), max_size=3, unique=True)
# The launch switches that change the kernel's code (addressing, the L2 prefetch of a later
# block): the interpreter skips the prefetch itself but runs the index and address arithmetic.
LEAN = st.booleans()
PREFETCH = st.sampled_from([0, 2])


# ---------------------------------------------------------------------------------------------
# Prefill


def prefill_inputs(seed, strided=False, device="cpu", **params):
    """The sparse_prefill spec's inputs (q, kv with unreferenced rows NaN, indices, topk_length,
    attn_sink) and the valid mask; `strided`: q's heads and kv's rows further apart than 576
    elements (copied into wider NaN-filled tensors and sliced)."""
    kw = catalog.inputs("sparse_prefill", params, seed, device)
    q, kv, idx, length = kw["q"], kw["kv"], kw["indices"], kw["topk_length"]
    if strided:
        wide_q = q.new_full((q.shape[0], q.shape[1] + 3, 576), float("nan"))
        wide_q[:, : q.shape[1]] = q
        wide_kv = kv.new_full((kv.shape[0], 640), float("nan"))
        wide_kv[:, :576] = kv
        q, kv = wide_q[:, : q.shape[1]], wide_kv[:, :576]
    valid = (idx >= 0) & (idx < kv.shape[0])
    if length is not None:
        valid &= torch.arange(idx.shape[1], device=idx.device)[None, :] < length[:, None]
    return q, kv, idx, length, kw["attn_sink"], valid


@given(
    seed=SEEDS,
    tokens=st.integers(1, 3),
    heads=HEADS,
    kv_rows=st.integers(1, 300),  # below topk: -1 tails
    topk=st.integers(16, 256),
    invalid=PREFILL_INVALID,
    topk_length=st.sampled_from(["none", "random", "edges"]),  # edges: 0, 1, K - 1, K
    sink=st.sampled_from(["none", "finite", "inf"]),  # inf: +inf, -inf and finite heads mixed
    value_regime=REGIMES,
    sm_scale=SM_SCALES,
    strided=st.booleans(),
    lean=LEAN,
    prefetch=PREFETCH,
)
def test_triton_prefill_matches_reference(
    seed, tokens, heads, kv_rows, topk, invalid, topk_length, sink, value_regime, sm_scale, strided, lean, prefetch
):
    q, kv, idx, length, sink, valid = prefill_inputs(
        seed, strided, tokens=tokens, heads=heads, kv_rows=kv_rows, topk=topk, invalid=invalid,
        topk_length=topk_length, sink=sink, value_regime=value_regime, sm_scale=sm_scale,
    )
    config = AttentionConfig(lean_addressing=lean, l2_prefetch=prefetch)
    with buffers.poisoned():
        got = triton_prefill.sparse_prefill(q, kv, idx, sm_scale, length, sink, config=config)
    ref = R.sparse_prefill(q, kv, idx, sm_scale, topk_length=length, attn_sink=sink, magnitudes=True)
    ab = (ref.out_abs, ref.value_abs)
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


def decode_inputs(seed, device="cpu", **params):
    """The sparse_decode_fp8 spec's q, paged fp8_ds_mla cache (unselected slots and padding rows
    all 0xFF = NaN) and indices."""
    kw = catalog.inputs("sparse_decode_fp8", params, seed, device)
    return kw["q"], kw["kv_cache"], kw["indices"]


def decode_check_inputs(q, got, ref):
    """A decode case flattened to [B*S, H(, 512)] for `check_attention`: (got, ref, ab); `ref`
    with its magnitudes."""
    batch, s_q, heads, _ = q.shape
    flat = lambda x: x.transpose(1, 2).reshape(batch * s_q, heads)  # noqa: E731  [B,H,S] -> [B*S,H]
    lse = flat(ref.lse)
    ab = tuple(t.reshape(batch * s_q, heads, 512) for t in (ref.out_abs, ref.value_abs))
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
    seq_lens=st.lists(st.integers(1, 300), min_size=2, max_size=2),  # below topk: -1 tails
    page_size=st.sampled_from([1, 16, 64, 69]),
    stride_pad=st.sampled_from([0, 1]),
    invalid=DECODE_INVALID,
    rule=st.sampled_from(["pow2", "pow2", "raw"]),
    value_regime=REGIMES,
    sm_scale=SM_SCALES,
    splits=st.sampled_from([None, 1, 3]),
    lean=LEAN,
    prefetch=PREFETCH,
)
def test_triton_decode_matches_reference(
    seed, batch, s_q, heads, topk, seq_lens, page_size, stride_pad, invalid, rule, value_regime, sm_scale, splits,
    lean, prefetch
):
    q, cache, idx = decode_inputs(
        seed, batch=batch, s_q=s_q, heads=heads, topk=topk, seq_lens=seq_lens[:batch], page_size=page_size,
        stride_pad=stride_pad, invalid=invalid, scale_rule=rule, value_regime=value_regime, sm_scale=sm_scale,
    )
    config = AttentionConfig(num_splits=splits, lean_addressing=lean, l2_prefetch=prefetch)
    with buffers.poisoned():
        got = triton_decode.sparse_decode_fp8(q, cache, idx, sm_scale, config=config)
    ref = R.sparse_decode_fp8(q, cache, idx, sm_scale, magnitudes=True)
    dequant_rel = DEQUANT_REL["bf16_dequant"] if rule == "raw" else 0.0  # the Triton decode's deviation
    check_attention(f"triton decode ({rule} scales)", *decode_check_inputs(q, got, ref),
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
    topk, sm_scale = 2048, 0.1352
    q, kv, idx, length, sink, valid = prefill_inputs(
        heads, device="cuda", tokens=48, heads=heads, kv_rows=6000, topk=topk, value_regime="normal",
        sm_scale=sm_scale, invalid=["scattered", "negatives", "out_of_range"], topk_length="edges", sink="finite",
    )
    got = fn(q, kv, idx, sm_scale, length, sink)
    ref = R.sparse_prefill(q, kv, idx, sm_scale, topk_length=length, attn_sink=sink, magnitudes=True)
    ab = (ref.out_abs, ref.value_abs)
    check_attention(f"{name} prefill H={heads}", got, ref, ab, topk)


def _gpu_decode_params(batch, s_q, heads, stride_pad):
    """Production decode: top-k 2048 of 4096-token sequences on 64-slot pages, scattered -1."""
    return dict(batch=batch, s_q=s_q, heads=heads, topk=2048, seq_lens=[4096] * batch, page_size=64,
                stride_pad=stride_pad, invalid=["scattered"], scale_rule="pow2", value_regime="normal", sm_scale=0.1352)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton", "flash_mla"])
@pytest.mark.parametrize("batch,s_q,heads", [(1, 1, 128), (4, 2, 128), (64, 2, 64), (3, 1, 16)])
def test_gpu_decode_matches_reference(name, batch, s_q, heads):
    fn = _implementation("sparse_decode_fp8", name)
    q, cache, idx = decode_inputs(batch * 100 + heads, "cuda", **_gpu_decode_params(batch, s_q, heads, 1))
    got = fn(q, cache, idx, 0.1352)
    ref = R.sparse_decode_fp8(q, cache, idx, 0.1352, magnitudes=True)
    check_attention(f"{name} decode B={batch} S={s_q} H={heads}",
                    *decode_check_inputs(q, got, ref), 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(VARIANTS["prefill"]))
def test_gpu_triton_prefill_variants_agree_with_reference(name):
    """Every prefill launch variant the sweep times, compiled, at production top-k."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, kv, idx, _, _, valid = prefill_inputs(
        3, device="cuda", tokens=16, heads=128, kv_rows=3000, topk=2048, value_regime="normal", sm_scale=0.1,
        invalid=["scattered", "negatives", "out_of_range"],
    )
    got = triton_prefill.sparse_prefill(q, kv, idx, 0.1, config=VARIANTS["prefill"][name])
    ref = R.sparse_prefill(q, kv, idx, 0.1, magnitudes=True)
    ab = (ref.out_abs, ref.value_abs)
    check_attention(f"triton prefill [{name}]", got, ref, ab, 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(VARIANTS["decode"]))
@pytest.mark.parametrize("pad", [0, 1], ids=["packed", "padded"])
def test_gpu_triton_decode_variants_agree_with_reference(name, pad):
    """Every decode launch variant the sweep times, compiled, on a packed cache (the layout lean
    addressing specializes) and a padded one."""
    q, cache, idx = decode_inputs(7, "cuda", **_gpu_decode_params(3, 2, 128, pad))
    got = triton_decode.sparse_decode_fp8(q, cache, idx, 0.1352, config=VARIANTS["decode"][name])
    ref = R.sparse_decode_fp8(q, cache, idx, 0.1352, magnitudes=True)
    check_attention(f"triton decode [{name}]", *decode_check_inputs(q, got, ref), 2048)
