"""Today's reference gives main 5fb709e's results bit for bit (tests/reference_5fb709e.py) on the same
inputs: issue 48 trimmed its passes over the keys (|K| computed in place once, fp8 values widened
through bfloat16), not its arithmetic. Every value regime of the builders, both scale rules, empty
rows, sinks, float32, the three cache formats."""

import pytest
import torch

from mla_verify import reference as R
from mla_verify.equivalence import catalog
from tests import reference_5fb709e as before

PREFILL = dict(tokens=6, heads=16, kv_rows=300, topk=128, sm_scale=0.1, invalid=["negatives", "out_of_range"],
               topk_length="random", sink="finite", inputs=2)
DECODE = dict(batch=3, s_q=2, heads=16, topk=64, seq_lens=[70, 5, 130], page_size=16, sm_scale=0.1,
              invalid=["scattered", "boundaries"], stride_pad=1, inputs=2)
REGIMES = ("normal", "saturation", "outliers", "zero_tiles", "tiny", "peaked")


@pytest.fixture(autouse=True)
def one_thread():
    """A multithreaded float64 GEMM may split its work by the threads free at that moment (see
    tests/test_reference_attention.py): the bitwise comparisons run on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({8: torch.int64, 4: torch.int32}[t.element_size()])


def _same(new: R.AttentionResult, old: R.AttentionResult) -> None:
    """Equal bit for bit (NaN payloads and the sign of zeros included)."""
    for name, a, b in zip(R.AttentionResult._fields, new, old):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), name


def _flat(res: R.AttentionResult) -> R.AttentionResult:
    """A decode result laid out as a prefill's: out-like [B, S, H, 512] -> [B*S, H, 512], the rest
    [B, H, S] -> [B*S, H]."""
    return R.AttentionResult(*(None if t is None else t.flatten(0, 1) if t.dim() == 4 else t.transpose(1, 2).flatten(0, 1)
                               for t in res))


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("magnitudes", [False, True])
def test_prefill_bit_for_bit(regime, magnitudes):
    kw = catalog.inputs("sparse_prefill", {**PREFILL, "value_regime": regime}, 5)
    args = (kw["q"], kw["kv"], kw["indices"], kw["sm_scale"], kw["topk_length"], kw["attn_sink"])
    for dtype in (torch.float64, torch.float32):
        _same(R.sparse_prefill(*args, dtype=dtype, magnitudes=magnitudes),
              before.sparse_prefill(*args, dtype=dtype, magnitudes=magnitudes))


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("scale_rule", ["pow2", "raw"])
def test_fp8_decode_bit_for_bit(regime, scale_rule):
    kw = catalog.inputs("sparse_decode_fp8", {**DECODE, "value_regime": regime, "scale_rule": scale_rule}, 6)
    q, cache, idx = kw["q"], kw["kv_cache"], kw["indices"]
    idx[1, 0] = -1  # an empty row
    sink = torch.linspace(-3, 40, q.shape[2])
    for dtype, magnitudes, attn_sink in ((torch.float64, True, None), (torch.float64, False, sink), (torch.float32, True, sink)):
        new = R.sparse_decode(q, cache, idx, kw["sm_scale"], attn_sink, dtype=dtype, magnitudes=magnitudes)
        _same(_flat(new), before.sparse_decode(q, cache, idx, kw["sm_scale"], attn_sink, dtype=dtype, magnitudes=magnitudes))


@pytest.mark.parametrize("form", ["nvfp4", "bf16"])
def test_other_cache_formats_bit_for_bit(form):
    g = torch.Generator().manual_seed(8)
    kv = (torch.randn(4 * 16, 576, generator=g) * torch.logspace(-3, 3, 576)).bfloat16()
    if form == "nvfp4":
        cache = torch.full((4, 16, 352), 0xFF, dtype=torch.uint8)
        R.write_nvfp4_ds_mla_cache(kv, cache, torch.arange(64))
    else:
        cache = kv.view(4, 16, 576)
    q = torch.randn(2, 3, 8, 576, generator=g).bfloat16()
    idx = torch.randint(-1, 64, (2, 3, 32), generator=g, dtype=torch.int32)
    _same(_flat(R.sparse_decode(q, cache, idx, 0.07, magnitudes=True)), before.sparse_decode(q, cache, idx, 0.07, magnitudes=True))
