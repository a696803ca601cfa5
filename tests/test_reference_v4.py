"""Self-checks of the DeepSeek V4 / V4.1 reference: codecs against worked examples and their own
rounding bounds, page layouts byte for byte, the union attention against a per-row loop, and
the index builders against loops written from vLLM's and FlashInfer's definitions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mla_verify import reference as R
from mla_verify.reference import v41_fp4 as F4, v4_pages as P, v4_rows as V
from tests.v4_inputs import decode_case

SEEDS = st.integers(0, 2**31 - 1)


def _row(values: dict[int, float] | None = None, fill: float = 0.0) -> torch.Tensor:
    kv = torch.full((1, 512), fill)
    for d, v in (values or {}).items():
        kv[0, d] = v
    return kv.bfloat16()


# ---------------------------------------------------------------------------------------------
# Codecs


def test_v4_worked_example_scales_codes_and_rope():
    kv = _row({d: 336.0 for d in range(64)})  # tile 0: amax 336 -> 336/448 = 0.75 -> scale 1.0
    kv[0, 64:128] = -0.0                       # tile 1: all zero, signed
    kv[0, 448:] = torch.arange(64) - 31.5      # RoPE, verbatim
    data, scales = V.quantize_rows(kv, V.V4, "pow2")
    assert scales[0].tolist() == [127, 127 - 13, *[127 - 13] * 5, 0]  # zero tiles: 1e-4 -> 2^-13; pad byte 0
    # 336 = 1.3125 * 2^8 is halfway between e4m3's 320 and 352: ties go to the even code, 320.
    assert data[0, :64].view(torch.float8_e4m3fn).float().eq(320.0).all()
    assert data[0, 64:128].eq(0x80).all()  # -0 stays -0
    assert torch.equal(data[0, 448:].view(torch.bfloat16), kv[0, 448:])
    values = V.row_values(data, scales, V.V4)
    assert torch.signbit(values[0, 64:128]).all() and values[0, 0] == 320.0


def test_the_two_ue8m0_rules_differ_only_below_the_floor():
    kv = _row({0: 1e-3, 64: 448.0, 128: 0.0448 * 2})
    _, pow2 = V.quantize_rows(kv, V.V4, "pow2")
    _, amax = V.quantize_rows(kv, V.V4, "pow2_amax")
    # 1e-3 / 448 < 1e-4: FlashMLA's rule floors the scale at 2^-13, vLLM's takes 2^ceil(log2(1e-3/448)) = 2^-18.
    assert pow2[0, 0] == 127 - 13 and amax[0, 0] == 127 - 18
    assert pow2[0, 1] == amax[0, 1] == 127 and pow2[0, 2] == amax[0, 2]
    assert pow2[0, 3] == 127 - 13 and amax[0, 3] == 127 - 22  # an all-zero tile: 1e-4 / 448 -> 2^-22


def test_a_non_finite_tile_is_nan_and_its_neighbours_are_not():
    for fmt, tile in ((V.V4, 64), (V.V41, 32)):
        kv = _row({5: float("nan"), tile + 3: 1.0})
        data, scales = V.quantize_rows(kv, fmt)
        assert scales[0, 0] == 255 and data[0, :tile].eq(0x7F).all()
        values = V.row_values(data, scales, fmt)
        assert values[0, :tile].isnan().all() and not values[0, tile:].isnan().any()
    kv = _row({17: float("inf")})
    data, scales = F4.quantize_fp4_rows(kv)
    assert scales[0, 1] == 0x7F and data[0, 8:16].eq(0).all() and scales[0, 0] != 0x7F
    values = F4.fp4_row_values(data, scales)
    assert values[0, 16:32].isnan().all() and not values[0, :16].isnan().any()


def test_fp4_nibble_order_ties_and_signed_zero():
    # Tile 0 amax 6 -> scale e4m3(1.0): element 0 = 0.25 (a tie -> 0), 1 = 0.75 (tie -> 1.0),
    # 2 = -0.0 (code 8), 3 = 6.0 (code 7), 4 = 2.5 (tie -> 2.0, code 4), 5 = 5.0 (tie -> 4.0, code 6).
    kv = _row({0: 0.25, 1: 0.75, 2: -0.0, 3: 6.0, 4: 2.5, 5: 5.0})
    data, scales = F4.quantize_fp4_rows(kv)
    assert scales[0, 0] == 0x38  # e4m3 1.0
    assert data[0, :3].tolist() == [0x0 | 2 << 4, 8 | 7 << 4, 4 | 6 << 4]  # even element in the low nibble
    values = F4.fp4_row_values(data, scales)
    assert values[0, :6].tolist() == [0.0, 1.0, -0.0, 6.0, 2.0, 4.0] and torch.signbit(values[0, 2])
    zero_tile_scale = scales[0, 1].view(torch.float8_e4m3fn).float()
    assert zero_tile_scale == 2.0**-9  # the floor, e4m3's least subnormal


@settings(max_examples=8)
@given(seed=SEEDS, fmt=st.sampled_from(["V4", "V41", "V41_FP4"]), rule=st.sampled_from(V.SCALE_RULES))
def test_codecs_round_to_within_half_a_step_of_the_input(seed, fmt, rule):
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(6, 512, generator=g) * torch.logspace(-8, 4, 6)[:, None]).bfloat16()
    f = P.FORMATS[fmt]
    data, scales = P.quantize(kv, f, rule)
    got = (F4.fp4_row_values(data, scales) if f.fp8 is None else V.row_values(data, scales, f.fp8)).float()
    x = kv.float()
    if f.fp8 is None:  # e2m1 steps: 0.5 below 2, 1 below 4, 2 above; the scale's own rounding on top
        tile_scale = scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
        y = (x / tile_scale).abs()
        step = torch.where(y < 2, 0.5, torch.where(y < 4, 1.0, 2.0)) * tile_scale
        assert ((got - x).abs() <= step / 2 + (y - 6).clamp(min=0) * tile_scale).all()
    else:
        q = f.fp8.quantized
        tile_scale = V.ue8m0_values(scales[:, :q // f.fp8.tile]).float().repeat_interleave(f.fp8.tile, dim=1)
        y = (x[:, :q] / tile_scale).abs()
        e = torch.floor(torch.log2(y.clamp_min(2**-6)))
        step = torch.where(y >= 2**-6, torch.exp2(e - 3), 2.0**-9) * tile_scale
        assert ((got[:, :q] - x[:, :q]).abs() <= step / 2).all()
        assert torch.equal(got[:, q:], x[:, q:])


def test_pages_block_major_and_per_token_byte_positions():
    kv = torch.randn(3, 512).bfloat16()
    for name in P.FORMATS:
        f = P.FORMATS[name]
        cache = R.allocate_cache(2, 3, name, fill=0)
        assert cache.stride(0) % f.pad_to == 0 and cache.stride(0) >= 3 * f.width
        R.write_v4_cache(kv, cache, torch.tensor([4, 0, 2]), kv_format=name)
        data, scales = P.quantize(kv, f)
        flat = cache.as_strided((2 * cache.stride(0),), (1,))
        block1 = flat[cache.stride(0):]
        if f.block_major:  # token 0 at slot 4: block 1, offset 1
            assert torch.equal(block1[f.data_bytes: 2 * f.data_bytes], data[0])
            assert torch.equal(block1[3 * f.data_bytes + f.scale_bytes: 3 * f.data_bytes + 2 * f.scale_bytes], scales[0])
        else:
            assert torch.equal(block1[f.width: f.width + f.data_bytes], data[0])
            assert torch.equal(block1[f.width + f.data_bytes: 2 * f.width], scales[0])
    with pytest.raises(ValueError, match="width 528 with format 'V4'"):
        R.page_format(R.allocate_cache(1, 2, "V41"), "V4")


# ---------------------------------------------------------------------------------------------
# Union attention


def _loop_decode(kw, fmt, extra):
    """The union by its definition, one query row and head at a time."""
    q, cache, idx, scale = kw["q"], kw["kv_cache"], kw["indices"], kw["sm_scale"]
    batch, s_q, heads, _ = q.shape
    lists = [(cache, fmt, idx, kw["topk_length"])]
    if kw["extra_kv_cache"] is not None:
        lists.append((kw["extra_kv_cache"], extra, kw["extra_indices"], kw["extra_topk_length"]))
    out, lse = torch.zeros(batch, s_q, heads, 512, dtype=torch.float64), torch.zeros(batch, heads, s_q, dtype=torch.float64)
    for b in range(batch):
        for s in range(s_q):
            keys = [R.slot_values(c, R.page_format(c, f), torch.tensor([int(i)]))[0]
                    for c, f, ix, length in lists for j, i in enumerate(ix[b, s])
                    if i != -1 and (length is None or j < length[b])]
            for h in range(heads):
                if not keys:
                    lse[b, h, s] = math.inf
                    continue
                k = torch.stack(keys)
                logits = scale * (k @ q[b, s, h].double())
                lse[b, h, s] = torch.logsumexp(logits, 0)
                sink = math.inf if kw["attn_sink"] is None else float(kw["attn_sink"][h])
                factor = 1 / (1 + math.exp(min(sink - lse[b, h, s], 700.0))) if kw["attn_sink"] is not None else 1.0
                out[b, s, h] = torch.softmax(logits, 0) @ k * factor
    return out, lse


@pytest.mark.parametrize("fmt,extra", [("V4", "V4"), ("V41", "V41_FP4"), ("V41", "V41"), ("V4", None),
                                       ("V41_BLOCK", "V41_FP4_BLOCK")])
def test_union_decode_is_its_definition(fmt, extra):
    kw = decode_case(3, fmt=fmt, extra_fmt=extra, batch=2, s_q=2, heads=3, topk=12, extra_topk=7, block=5,
                     extra_block=3, sink="inf", gap=32)
    main = R.Paged(kw["kv_cache"], kw["indices"], kw["topk_length"], fmt)
    more = None if extra is None else R.Paged(kw["extra_kv_cache"], kw["extra_indices"], kw["extra_topk_length"], extra)
    res = R.sparse_decode_union(kw["q"], main, kw["sm_scale"], more, kw["attn_sink"])
    out, lse = _loop_decode(kw, fmt, extra)
    assert torch.equal(torch.isinf(res.lse), torch.isinf(lse))
    live = torch.isfinite(lse)
    assert torch.allclose(res.lse[live], lse[live], rtol=0, atol=1e-12)
    assert torch.allclose(res.out, out, rtol=0, atol=1e-12)
    assert not res.out.isnan().any()  # every poisoned slot (past a length, never selected) stayed unread


def test_an_empty_union_is_zero_with_lse_plus_inf_and_past_a_length_is_never_read():
    kw = decode_case(5, batch=2, s_q=1, heads=2, topk=8, extra_topk=8, lengths="none", extra_lengths="none",
                     invalid_rate=0.0, sink="finite")
    kw["indices"][0] = -1
    kw["extra_topk_length"] = torch.tensor([0, 8], dtype=torch.int32)
    kw["extra_indices"][0] = 2**31 - 1  # past the length: anything, never read, never refused
    res = R.sparse_decode_v4(**kw)
    assert res.out[0].eq(0).all() and res.lse[0].eq(math.inf).all() and res.max_logits[0].eq(-math.inf).all()
    assert res.lse[1].isfinite().all()
    kw["extra_topk_length"] = torch.tensor([1, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="extra_indices entry 2147483647 at row 0, position 0 counts"):
        R.sparse_decode_v4(**kw)


def test_union_is_the_lse_merge_of_its_parts():
    kw = decode_case(7, batch=2, s_q=2, heads=4, topk=16, extra_topk=12, sink="none")
    both = R.sparse_decode_v4(**kw)
    main = R.sparse_decode_v4(**{**kw, "extra_kv_cache": None, "extra_indices": None, "extra_topk_length": None})
    extra = R.sparse_decode_v4(kw["q"], kw["extra_kv_cache"], kw["extra_indices"], kw["sm_scale"],
                               kw["extra_topk_length"])
    outs = torch.stack([main.out, extra.out])
    lses = torch.stack([main.lse.transpose(1, 2), extra.lse.transpose(1, 2)])
    out, lse = R.dcp_merge_exact(outs, lses)
    assert torch.allclose(out, both.out, rtol=0, atol=1e-12)
    assert torch.equal(torch.isinf(lse), torch.isinf(both.lse.transpose(1, 2)))


def test_prefill_union_is_the_decode_union_over_bf16_rows():
    kw = decode_case(9, batch=3, s_q=1, heads=2, topk=10, extra_topk=6, block=4, extra_block=4, sink="inf")
    rows = R.slot_values(kw["kv_cache"], R.page_format(kw["kv_cache"]), torch.arange(kw["kv_cache"].shape[0] * 4))
    xrows = R.slot_values(kw["extra_kv_cache"], R.page_format(kw["extra_kv_cache"]),
                          torch.arange(kw["extra_kv_cache"].shape[0] * 4))
    dec = R.sparse_decode_v4(**kw)
    pre = R.sparse_prefill_union(kw["q"][:, 0], R.Rows(rows.nan_to_num(0).bfloat16(), kw["indices"][:, 0], kw["topk_length"]),
                                 kw["sm_scale"], R.Rows(xrows.nan_to_num(0).bfloat16(), kw["extra_indices"][:, 0],
                                                        kw["extra_topk_length"]), kw["attn_sink"])
    assert torch.allclose(pre.out, dec.out[:, 0], rtol=0, atol=1e-12)
    assert torch.equal(pre.lse, dec.lse[:, :, 0])


# ---------------------------------------------------------------------------------------------
# Index builders


def test_window_indices_by_definition():
    table = torch.randperm(40).view(2, 20).int()
    pos = torch.tensor([0, 3, 126, 127, 128, 200])
    req = torch.tensor([0, 0, 1, 1, 1, 0])
    idx, lengths = R.window_indices(pos, req, table, 16, 128)
    for t in range(6):
        w = min(int(pos[t]) + 1, 128)
        want = [int(table[req[t], p // 16]) * 16 + p % 16 for p in range(int(pos[t]) - w + 1, int(pos[t]) + 1)]
        assert idx[t].tolist() == want + [-1] * (128 - w) and lengths[t] == w


def test_v4_prefill_rows_by_vllm_definition():
    g = torch.Generator().manual_seed(0)
    qsl = torch.tensor([7, 10, 11, 16])  # rebased to its first entry
    seq, gather = torch.tensor([10, 1, 300]), torch.tensor([10, 1, 130])
    picks = torch.randint(0, 50, (9, 20), generator=g).int()
    rows, lengths = R.v4_prefill_indices(picks, qsl, seq, gather, 128, 4, 16, 1000, 50)
    assert rows.shape == (9, 256)
    t = 0
    for r in range(3):
        qlen = int(qsl[r + 1] - qsl[r])
        for i in range(qlen):
            pos = int(seq[r]) - qlen + i
            k, w = min((pos + 1) // 4, 16), min(pos + 1, 128)
            first = 1000 * r + 50 + pos - w + 1 - int(seq[r] - gather[r])
            want = [int(p) + 1000 * r for p in picks[t, :k]] + list(range(first, first + w))
            assert rows[t].tolist() == want + [-1] * (256 - k - w) and lengths[t] == k + w
            t += 1
    bad = picks.clone()
    bad[8, 3] = 50
    with pytest.raises(ValueError, match="token 8's pick 3 is 50"):
        R.v4_prefill_indices(bad, qsl, seq, gather, 128, 4, 16, 1000, 50)


def test_flashinfer_table_reads_as_the_flashmla_union():
    """The two conventions agree: FlashInfer's one table (lengths counting the whole window,
    window validity from the position) attends to what FlashMLA's two lists do."""
    kw = decode_case(11, batch=4, s_q=1, heads=2, topk=128, extra_topk=10, block=64, extra_block=4, lengths="none",
                     extra_lengths="random", invalid_rate=0.0, sink="finite")
    pos = torch.tensor([0, 5, 127, 300])
    window = kw["indices"][:, 0].clone()
    w = torch.clamp(pos + 1, max=128)
    window[torch.arange(128)[None, :] >= w[:, None]] = -1
    kw["indices"], kw["topk_length"] = window[:, None], w.int()
    flashmla = R.sparse_decode_v4(**kw)
    table, lengths = R.flashinfer_decode_table(window, kw["extra_indices"][:, 0], kw["extra_topk_length"])
    assert table.shape == (4, 128 + 12) and lengths.tolist() == (128 + kw["extra_topk_length"]).tolist()
    read = R.flashinfer_table_as_union(table, lengths, pos, 128)
    flashinfer = R.sparse_decode_v4(kw["q"], kw["kv_cache"], read["indices"], kw["sm_scale"], read["topk_length"],
                                    kw["extra_kv_cache"], read["extra_indices"], read["extra_topk_length"],
                                    kw["attn_sink"])
    assert torch.equal(flashinfer.out, flashmla.out) and torch.equal(flashinfer.lse, flashmla.lse)
