"""Serving's shapes that only a GPU can pose (issue 47; gpu-marked, skipped on a CPU with the
reason printed; not yet run on a GPU):

* repeated launches at large s_q and top-k (SGLang #32327, a cross-iteration race): property:stress
  on a decode of 64 requests x 4 tokens x 128 heads at top-k 2048, every implementation here;
* offsets past 2**31 bytes: a decode cache and a prefill kv array larger than 2 GiB whose selected
  rows all lie past that offset (a kernel computing byte offsets in 32 bits reads elsewhere),
  against the reference.
"""

import math

import pytest
import torch

from mla_verify import reference
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.catalog import evaluate, get_spec, resolve_subject
from mla_verify.optimized import registry
from mla_verify.reference.fp8_ds_mla import ROW_BYTES

pytestmark = pytest.mark.gpu
PAST_2_31 = 2**31 + (64 << 20)  # bytes: the selected rows start 64 MiB past the 32-bit boundary


def test_repeated_launches_at_large_s_q_and_top_k_give_the_same_bits():
    spec = get_spec("property:stress")
    case = Case(spec.name, {"target": "sparse_decode_fp8", "batch": 64, "s_q": 4, "heads": 128, "topk": 2048,
                            "seq_lens": [2048 + 97 * i for i in range(64)], "page_size": 64, "sm_scale": 0.1352,
                            "value_regime": "normal", "scale_rule": "pow2", "invalid": ["scattered"]}, 32327)
    for impl in spec.subjects("cuda"):
        rows = evaluate(case, resolve_subject(spec.name, [impl], "cuda"), "cuda")
        assert rows and all(r.passed for r in rows), (impl, [r.reason for r in rows if not r.passed])


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within a few bf16 ulps of the float64 answer (the kernels' own bounds are the oracle's; a
    row read from the wrong place is off by its whole size)."""
    return bool(((got.double() - want.double()).abs() <= 2**-6 * want.double().abs() + 1e-3).all())


def test_a_decode_cache_past_2_31_bytes_reads_its_rows_there():
    device, page = "cuda", 64
    blocks = math.ceil(PAST_2_31 / (page * ROW_BYTES)) + 4
    gen = torch.Generator(device=device).manual_seed(31)
    cache = torch.full((blocks, page, ROW_BYTES), 0xFF, dtype=torch.uint8, device=device)
    first = (blocks - 4) * page  # every selected slot past 2**31 bytes
    rows = torch.randn((4 * page, 576), generator=gen, device=device).to(torch.bfloat16)
    cache.view(-1, ROW_BYTES)[first:] = reference.quantize_fp8_ds_mla(rows, "pow2")
    q = torch.randn((2, 1, 64, 576), generator=gen, device=device).to(torch.bfloat16)
    indices = (first + torch.randperm(4 * page, generator=gen, device=device)[:2 * 128]).view(2, 1, 128).to(torch.int32)
    want = reference.sparse_decode_fp8(q, cache, indices, 0.1352)
    for impl in registry.implementations("sparse_decode_fp8"):
        if impl.why_not(device) is None:
            out, lse = impl.fn(q=q, kv_cache=cache, indices=indices, sm_scale=0.1352)[:2]
            assert _close(out, want.out) and _close(lse, want.lse), impl.name


def test_a_prefill_kv_array_past_2_31_bytes_reads_its_rows_there():
    device = "cuda"
    n = math.ceil(PAST_2_31 / (576 * 2)) + 512
    gen = torch.Generator(device=device).manual_seed(31)
    kv = torch.full((n, 576), float("nan"), dtype=torch.bfloat16, device=device)
    kv[n - 512:] = torch.randn((512, 576), generator=gen, device=device).to(torch.bfloat16)
    q = torch.randn((4, 64, 576), generator=gen, device=device).to(torch.bfloat16)
    indices = (n - 512 + torch.randperm(512, generator=gen, device=device)[:4 * 128]).view(4, 128).to(torch.int32)
    want = reference.sparse_prefill(q, kv, indices, 0.1352)
    for impl in registry.implementations("sparse_prefill"):
        if impl.why_not(device) is None:
            out, lse = impl.fn(q=q, kv=kv, indices=indices, sm_scale=0.1352, topk_length=None, attn_sink=None)[:2]
            assert _close(out, want.out) and _close(lse, want.lse), impl.name
