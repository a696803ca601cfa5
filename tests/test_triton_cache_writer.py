"""Our Triton fp8_ds_mla writer and reader (quantize, dequantize, write_fp8_ds_mla_cache) against the
reference, bit for bit, and their refusal of bad inputs before any launch.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mla_verify import reference as R
from mla_verify.equivalence.cases.values import kv_values
from mla_verify.optimized.kernels import launch
from mla_verify.optimized.kernels.cache_writer import dequantize_fp8_ds_mla, quantize_fp8_ds_mla, write_fp8_ds_mla_cache
from mla_verify.optimized.validation import InputError
from tests.triton_glue_helpers import (  # noqa: F401  (no_launch: a fixture)
    BLOCK_SIZES, DEVICE, KV_REGIMES, _expect_refusal, _gen, _kv, assert_same_bits, no_launch, poisoned_outputs, seeds,
)


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


def test_triton_kernels_refuse_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    with pytest.raises(InputError, match="TRITON_INTERPRET=1"):
        quantize_fp8_ds_mla(torch.ones(2, 576, dtype=torch.bfloat16))
