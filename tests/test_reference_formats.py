"""Self-checks of the reference cache formats: worked examples bit-exact, rounding bounds."""

import torch
from hypothesis import given, strategies as st

from mla_verify import reference as R
from mla_verify.equivalence.cases.values import REGIMES, kv_values
from mla_verify.reference import fp8_ds_mla as F8, nvfp4_ds_mla as F4

seeds = st.integers(0, 2**31 - 1)


def test_worked_example_scales_and_exact_roundtrip():
    # vLLM's writer->decoder regression test: 336 in three tiles, zeros in the fourth.
    kv = torch.zeros(1, 576, dtype=torch.bfloat16)
    kv[0, :384] = 336.0
    kv[0, 512:] = torch.arange(64, dtype=torch.bfloat16) - 31.5
    nope, scales, rope = F8.unpack_fp8_ds_mla(F8.quantize_fp8_ds_mla(kv, "pow2"))
    assert scales.tolist() == [[1.0, 1.0, 1.0, 2.0**-13]]  # 336/448 = 0.75 -> 1.0; 0 -> 1e-4 -> 2**-13
    assert torch.equal(rope, kv[:, 512:])
    # 336 = 1.3125 * 2**8 lies halfway between e4m3's 320 and 352: ties go to the even code, 320.
    assert torch.equal(nope[0, :384].float(), torch.full((384,), 320.0))
    assert torch.equal(nope[0, 384:].float(), torch.zeros(128))


def test_raw_scale_is_amax_over_448():
    kv = torch.full((1, 576), 3.0, dtype=torch.bfloat16)
    _, scales, _ = F8.unpack_fp8_ds_mla(F8.quantize_fp8_ds_mla(kv, "raw"))
    assert torch.equal(scales, torch.full((1, 4), 3.0) / 448.0)


def test_pow2_scale_is_the_smallest_power_of_two_at_or_above():
    amax = torch.tensor([448.0, 448.0 * 1.0001, 0.0, 1e-9, 1e-4 * 448, 300.0, 2**20])
    kv = torch.zeros(len(amax), 576)
    kv[:, 0] = amax
    scales = F8.tile_scales(kv[:, :512].bfloat16().float(), "pow2")[:, 0]
    ratio = torch.clamp_min(kv[:, 0].bfloat16().float() / 448, 1e-4).double()
    assert torch.equal(torch.log2(scales.double()), torch.log2(scales.double()).round())  # powers of two
    assert bool((scales >= ratio).all()) and bool((scales / 2 < ratio).all())


@given(seed=seeds, regime=st.sampled_from(REGIMES), rule=st.sampled_from(F8.SCALE_RULES))
def test_fp8_roundtrip_within_half_an_e4m3_step(seed, regime, rule):
    kv = kv_values(torch.Generator().manual_seed(seed), 8, regime)
    rows = F8.quantize_fp8_ds_mla(kv, rule)
    nope, scales, rope = F8.unpack_fp8_ds_mla(rows)
    assert torch.equal(rope, kv[:, 512:])
    x = kv[:, :512].double().view(8, 4, 128)
    s = scales.double()[..., None]
    q = nope.double().view(8, 4, 128)
    assert bool((q.abs() <= 448).all()) and not bool(torch.isnan(q).any())
    # e4m3: 3 mantissa bits; normal steps 2**(e-3), subnormal step 2**-9 (in units of the scale).
    y = (x / s).abs().clamp(max=448)
    step = torch.where(y >= 2**-6, torch.exp2(torch.floor(torch.log2(y.clamp_min(2**-6))) - 3), torch.full_like(y, 2**-9))
    # x / s is an fp32 division (the contract), so a quotient within 2**-24 of a midpoint may land
    # on it and round either way: allow half a step plus that fp32 rounding of the quotient.
    assert bool(((q - (x / s).clamp(-448, 448)).abs() <= step / 2 + y * 2**-23).all())
    exact = F8.fp8_ds_mla_values(rows)
    assert torch.equal(exact[:, :512].view(8, 4, 128), q * s)
    deq = F8.dequantize_fp8_ds_mla(rows)
    assert torch.equal(deq[:, :512], (nope.float().view(8, 4, 128) * scales[..., None]).view(8, 512).bfloat16())
    if rule == "pow2":
        assert torch.equal(deq.double(), exact)  # power-of-two scales: bf16 holds the exact value


@given(seed=seeds, regime=st.sampled_from(REGIMES), rounding=st.sampled_from(F4.SCALE_ROUNDINGS))
def test_nvfp4_roundtrip_and_layout(seed, regime, rounding):
    kv = kv_values(torch.Generator().manual_seed(seed), 4, regime)
    rows = F4.quantize_nvfp4_ds_mla(kv, rounding)
    values = F4.nvfp4_ds_mla_values(rows)
    assert torch.equal(F4.dequantize_nvfp4_ds_mla(rows).double(), values)  # exact in bf16
    # RoPE: e4m3 of the bf16 input, unscaled.
    assert torch.equal(values[:, 512:], kv[:, 512:].float().clamp(-448, 448).to(torch.float8_e4m3fn).double())
    # Scale byte of block s sits at 320 + 8*(s%4) + s//4; re-derive block 5's scale by hand.
    amax5 = kv[:, 80:96].float().abs().amax(-1)
    sf5 = rows[:, 320 + 8 * 1 + 1].view(torch.float8_e4m3fn).float()
    wanted = torch.clamp(amax5 / 6, 2.0**-9, 448.0)  # e4m3 saturates at 448
    assert bool((sf5 >= wanted * (1 - 2**-4)).all()) and bool((sf5 <= wanted * (1 + 2**-3)).all())
    if rounding == "up":
        assert bool(((sf5 >= wanted) | (rows[:, 329] >= 0x7E)).all())
    # Error bound: e2m1 steps are 0.5 below 2, 1 up to 4, 2 up to 6 (times the scale).
    sf = rows[:, 320 + F4.scale_position(torch.arange(32))].view(torch.float8_e4m3fn).double()
    y = (kv[:, :512].double().view(4, 32, 16) / sf[..., None])
    err = (values[:, :512].view(4, 32, 16) / sf[..., None] - y.clamp(-6, 6)).abs()
    half_step = torch.where(y.abs() < 2, 0.25, torch.where(y.abs() < 4, 0.5, 1.0))
    assert bool((err <= half_step + 1e-9).all())


def test_e2m1_ties_go_to_even():
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75])
    codes = F4.e2m1_codes(y)
    assert codes.tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 10]


def test_scatter_rows_skips_negative_slots_and_honours_block_stride():
    storage = torch.zeros(3, 6, 4)
    cache = storage[:, :4]  # stride(0) = 6 rows: two rows of other layers between blocks
    rows = torch.arange(12.0).view(3, 4) + 1
    R.paged_cache.scatter_rows(rows, cache, torch.tensor([5, -1, 8]))
    assert torch.equal(cache[1, 1], rows[0]) and torch.equal(cache[2, 0], rows[2])
    assert int((storage != 0).any(-1).sum()) == 2
    flat, stride_rows = R.flat_kv_row_view(cache)
    assert stride_rows == 6 and flat.shape == (2 * 6 + 4, 4)
    assert torch.equal(flat[1 * 6 + 1], rows[0]) and torch.equal(flat[2 * 6 + 0], rows[2])
