"""The routing boundaries of the backend (equivalence.cases.routing): each side named for batches built
by hand from the spec's examples, and every side drawn by forward_mqa's draws at the gpu and
nightly profiles (scripts/routing_table.py: docs/scope.md's table, the same 1000 draws)."""

import importlib.util
from pathlib import Path

import pytest

from mla_verify.equivalence.cases.routing import SIDES, sides

REPO = Path(__file__).resolve().parent.parent
BASE = dict(cache_dtype="fp8_ds_mla", heads=64, topk=2048, arch="sm90", max_decode_query_len=1, dcp_size=1,
            interleave=1, mqa="all", max_model_len=None, workspace_size=None)


def batch(**fields):
    return {**BASE, **fields}


@pytest.mark.parametrize("fields, boundary, want", [
    (dict(heads=16, query_lens=[1], context_lens=[9]), "fp8_path", ["mixed (H < 32)"]),
    (dict(heads=32, query_lens=[1], context_lens=[9]), "fp8_path", ["separate (H >= 32)"]),
    (dict(cache_dtype="bfloat16", query_lens=[1], context_lens=[9]), "fp8_path", []),
    (dict(heads=16, topk=576, query_lens=[1], context_lens=[9]), "decode_topk", ["K % 128 == 64"]),
    (dict(heads=64, topk=2048, query_lens=[300], context_lens=[9]), "decode_topk", []),  # no decode kernel call
    # qsl [0, 1, 3, 6] at threshold 256: one decode, then two short prefills
    (dict(query_lens=[1, 2, 3], context_lens=[5, 5, 5]), "split", ["decodes + prefills", "a short prefill (<= threshold)"]),
    # 7 requests of 110 tokens, the 7th empty (padding): all decodes, 6 active
    (dict(query_lens=[110] * 6 + [0], context_lens=[50] * 7), "split", ["all decodes", "with padding requests"]),
    (dict(query_lens=[300, 1], context_lens=[0, 5]), "split", ["all prefills", "a short prefill (<= threshold)"]),
    # s = 2 decodes, a padding request, then a request of 2 tokens: the uniform split makes it a decode
    (dict(query_lens=[2, 2, 0, 2, 5], context_lens=[9] * 5, max_decode_query_len=2), "split",
     ["decodes + prefills", "a short prefill (<= threshold)", "a prefill as long as the decodes"]),
    # prefill sequences [2, 3, 4, 2] in a workspace of 5: chunks (0,2), (2,3), (3,4)
    (dict(query_lens=[1, 2, 3, 4, 2], context_lens=[5, 0, 0, 0, 0], workspace_size=5), "chunks", [">= 3 chunks"]),
    (dict(query_lens=[1, 2, 3], context_lens=[5, 0, 0], workspace_size=5), "chunks", ["1 chunk"]),
    (dict(heads=16, query_lens=[1, 2, 3], context_lens=[5, 0, 0], workspace_size=5), "chunks", []),  # mixed path
    (dict(heads=16, dcp_size=4, query_lens=[1], context_lens=[2]), "dcp_empty", ["a rank empty for a request"]),
    (dict(heads=16, dcp_size=2, interleave=2, query_lens=[1], context_lens=[3]), "dcp_empty",
     ["every rank holds every request"]),
])
def test_each_boundary_names_the_side_a_batch_is_on(fields, boundary, want):
    assert sides(batch(**fields))[boundary] == want


def test_every_side_of_every_boundary_is_drawn_at_the_gpu_and_nightly_profiles(capsys):
    spec = importlib.util.spec_from_file_location("routing_table", REPO / "scripts" / "routing_table.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    code = script.main(["--draws", "1000", "--profile", "gpu", "--profile", "nightly"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert sum(line.count("| ") > 2 for line in text.splitlines()) == 2 + sum(len(s) for s in SIDES.values())
