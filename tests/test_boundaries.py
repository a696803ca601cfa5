"""The exact edges of the valid index range are drawn (issue 15: a mutant treating prefill index
== N as valid survived 100 examples when out-of-range values came uniformly from [N, 2**31)),
and the gpu profile draws prefills over several workspace chunks (a chunker that dropped the last
chunk survived 100 gpu-profile examples)."""

from hypothesis import HealthCheck, given, settings

from mla_verify.equivalence import catalog
from mla_verify.equivalence.catalog import evaluate, get_spec, resolve_subject
from mla_verify.equivalence.cases.profiles import get_profile
from mla_verify.fuzz.campaign import Campaign, each, fuzz
from mla_verify.reference.metadata import reorder_batch_threshold, split_decodes_and_prefills, split_prefill_chunks


def test_prefill_draws_n_and_n_minus_one_and_every_length_edge():
    p = dict(tokens=64, heads=1, kv_rows=300, topk=128, value_regime="normal", sm_scale=0.1,
             invalid=["boundaries"], topk_length="edges")
    kw = catalog.inputs("sparse_prefill", p, 3)
    assert {300, 299} <= set(kw["indices"].flatten().tolist())
    assert {0, 1, 127, 128} == set(kw["topk_length"].tolist())


def test_decode_draws_the_last_slot_and_convert_the_table_width():
    p = dict(batch=8, s_q=1, heads=16, topk=64, seq_lens=[70] * 8, page_size=16, value_regime="normal",
             scale_rule="pow2", sm_scale=0.1, invalid=["boundaries"])
    kw = catalog.inputs("sparse_decode_fp8", p, 3)
    cache = kw["kv_cache"]
    assert cache.shape[0] * cache.shape[1] - 1 in set(kw["indices"].flatten().tolist())
    p = dict(tokens=32, requests=3, table_width=4, topk=64, block_size=16, invalid=["boundaries"])
    kw = catalog.inputs("convert_index", p, 3)
    assert {64, 63} <= set(kw["topk_indices"].flatten().tolist())  # first past the table, its last slot


def test_a_prefill_that_reads_index_n_is_caught():
    subject = resolve_subject("sparse_prefill", ["tests.zoo.attention:index_n_is_valid"], "cpu")
    result = fuzz(Campaign("sparse_prefill", get_profile("ci"), 200, 21, shrink=False),
                  each(lambda case, source: evaluate(case, subject, "cpu", source=source)))
    print(f"index_n_is_valid: first failure at example {result.first_failure_at}")
    assert result.failure is not None


def test_gpu_profile_draws_multi_chunk_prefills():
    spans = []

    @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(get_spec("forward_mqa").strategy(get_profile("gpu"), "fp8_separate"))
    def draw(case):
        p = case.params
        qsl = [0]
        for n in p["query_lens"]:
            qsl.append(qsl[-1] + n)
        threshold = reorder_batch_threshold(p["heads"], p["arch"], max_decode_query_len=p["max_decode_query_len"])
        first = split_decodes_and_prefills(qsl, threshold).num_decodes
        seqs = [c + n for c, n in zip(p["context_lens"][first:], p["query_lens"][first:])]
        if p["workspace_size"] and len(seqs) >= 2 and p["mqa"] == "all":
            spans.append(len(split_prefill_chunks(seqs, p["workspace_size"])))

    draw()
    assert spans and all(n >= 2 for n in spans)  # every chunked draw with two prefills spans chunks
    assert len(spans) >= 20
