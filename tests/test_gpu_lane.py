"""On a GPU: the reference computes the same answers on CUDA as on CPU, and every corpus case
passes for every implementation that runs there (flash_mla, compiled Triton, torch-fp32)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mla_verify.equivalence.catalog import evaluate, get_spec, names, resolve_subject
from mla_verify.fuzz.regressions import corpus

REPO = Path(__file__).resolve().parent.parent
CASES = [(op, case) for op in names("op") for case, _ in corpus(op)]


def to_cpu(obj):
    """A CPU copy of a case's inputs, every tensor with its strides and offset (padded caches)."""
    if isinstance(obj, torch.Tensor):
        copy = torch.empty(0, dtype=obj.dtype)
        return copy.set_(obj.untyped_storage().cpu(), obj.storage_offset(), obj.size(), obj.stride())
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: to_cpu(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    return obj


@pytest.mark.gpu
@pytest.mark.parametrize("op, case", CASES, ids=[f"{op}-{c.case_id}" for op, c in CASES])
def test_reference_on_cuda_matches_cpu(op, case):
    spec = get_spec(op)
    params = spec.params_of(case.params)
    inputs = spec.inputs(params, case.seed, "cuda")
    on_cpu = spec.reference(to_cpu(inputs), params)
    on_gpu = spec.reference(inputs, params)
    for name, ref in on_cpu.items():
        got = on_gpu[name].cpu()
        if ref.is_floating_point() and ref.dtype == torch.float64:
            assert torch.equal(torch.isinf(got), torch.isinf(ref)) and torch.equal(torch.isnan(got), torch.isnan(ref))
            finite = torch.isfinite(ref)
            # float64 answers differ by summation order only; the logit scale is computed in fp32, and
            # the derived bounds (BoundKey(NAME_bound, DEVIATION)) grow with it.
            bound = isinstance(name, tuple)
            rtol = 1e-5 if bound or "logit_l1" in name else 1e-12  # also partial_logit_l1_rank{r}
            assert torch.allclose(got[finite], ref[finite], rtol=rtol, atol=rtol), name
        else:
            # Bits compared through a byte view, which needs a dense last dim (an expanded scalar has stride 0).
            got, ref = got.contiguous(), ref.contiguous()
            assert torch.equal(got.view(torch.uint8) if ref.is_floating_point() else got,
                               ref.view(torch.uint8) if ref.is_floating_point() else ref), name


@pytest.mark.gpu
@pytest.mark.parametrize("op, case", CASES, ids=[f"{op}-{c.case_id}" for op, c in CASES])
def test_corpus_passes_for_every_implementation_on_cuda(op, case):
    for label, specs in get_spec(op).subjects("cuda").items():
        rows = evaluate(case, resolve_subject(op, specs, "cuda"), "cuda", source="corpus")
        failing = [f"{label} {r.tensor}: {r.reason}" for r in rows if not r.passed]
        assert not failing, failing


def test_the_properties_script_runs_its_loop_on_cpu(tmp_path, capsys):
    """scripts/gpu_properties.py (the lane's `properties` step) walks each property's subjects and
    targets, writes its rows and prints its table; on CPU one drawn case per target, no pinned ones."""
    import importlib.util

    from mla_verify import reports

    spec = importlib.util.spec_from_file_location("gpu_properties", REPO / "scripts" / "gpu_properties.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    code = script.main(["--device", "cpu", "--no-pinned", "--examples", "1", "--impl", "torch-fp32",
                        "--property", "determinism", "--property", "cuda_graph", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    assert code == 0, text
    rows = reports.load_run(tmp_path)[0]
    assert set(rows["path"]) == {"determinism"} and set(rows["impl"]) == {"torch-fp32"}
    assert {json.loads(c)["params"]["target"] for c in rows["case"]} == set(get_spec("property:determinism").targets)
    assert all(f"determinism            rerun.{t}" in text for t in ("out", "lse")), text
