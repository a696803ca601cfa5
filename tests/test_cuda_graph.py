"""property:cuda_graph: FlashMLA and our Triton kernels, captured in a CUDA graph on static buffers,
replay bit for bit what they compute eagerly and stay within the reference's bounds, at production
shapes and the gpu profile's; the graph-unsafe kernels of tests/hostile/graph.py fail it (in the
isolation worker, the next case passing in a fresh one) and a saved case replays. On CPU the
property is refused with its reason."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from mla_verify.cli import main
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.catalog import evaluate, get_spec, resolve_subject
from mla_verify.equivalence.cases.profiles import get_profile
from mla_verify.fuzz.campaign import Campaign, each, fuzz, new_seed
from mla_verify.fuzz.production import production_cases
from tests.hostile import GRAPH
from tests.test_properties import TINY  # shapes the Triton interpreter runs in a second

REPO = Path(__file__).resolve().parent.parent
OP = "property:cuda_graph"
SMALL = {
    "sparse_prefill": {"tokens": 4, "heads": 64, "kv_rows": 300, "topk": 128, "value_regime": "normal", "sm_scale": 0.1,
                       "invalid": ["scattered"], "topk_length": "random", "sink": "finite"},
    "sparse_decode_fp8": {"batch": 3, "s_q": 2, "heads": 64, "topk": 128, "seq_lens": [100, 40, 300], "page_size": 64,
                          "stride_pad": 1, "value_regime": "normal", "scale_rule": "raw", "sm_scale": 0.1,
                          "invalid": ["scattered"]},
}


def small_case(target: str, seed: int = 5) -> Case:
    return Case(OP, {"target": target, **SMALL[target], "replay_seeds": [21, 22, 23]}, seed)


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_on_cpu_the_property_is_refused_with_its_reason(capsys, tmp_path):
    spec = get_spec(OP)
    assert spec.subjects("cpu") == {}
    code, text = run_cli(capsys, "fuzz", "--op", OP, "--device", "cpu", "--out", str(tmp_path))
    assert code == 2 and "captures CUDA graphs: it runs on a CUDA device only" in text
    code, text = run_cli(capsys, "list", "--device", "cpu")
    assert code == 0 and "skipped on cpu: captures CUDA graphs" in text


def test_the_eager_kernels_are_no_graph_kernels():
    """torch-fp32 indexes with boolean masks (a host sync each): no graph entry, so the property
    never runs it; flash_mla's and Triton's entries are their launch paths."""
    from mla_verify.optimized import registry

    spec = get_spec(OP)
    impls = [i for stage in ("sparse_prefill", "sparse_decode_fp8", "convert_index") for i in registry.implementations(stage)]
    assert sorted(spec._no_graph(impls)) == ["convert_index torch-fp32", "sparse_decode_fp8 torch-fp32",
                                             "sparse_prefill torch-fp32"]
    assert {i.graph.__name__ for i in impls if i.graph} == {"launch_sparse_prefill", "launch_sparse_decode_fp8",
                                                            "launch_convert_index"}


def test_every_small_case_and_replay_seed_is_a_valid_case():
    from mla_verify.equivalence.catalog import validate_case

    for target in SMALL:
        validate_case(small_case(target).to_dict())
    with pytest.raises(ValueError, match="replay_seeds"):
        validate_case({**small_case("sparse_prefill").to_dict(), "params": {**SMALL["sparse_prefill"],
                                                                            "target": "sparse_prefill"}})


def test_a_padded_capture_grows_the_rows_with_padding_and_its_checks_name_them():
    """capture 2 / 4: serving's padded batch (every padding index -1, the query rows whatever the
    buffer held); the property's params take 1, 2, 4 and its draws pose all three."""
    from mla_verify.equivalence.catalog import validate_case
    from mla_verify.equivalence.properties.cuda_graph import _padded

    kw = get_spec("sparse_prefill").inputs(get_spec("sparse_prefill").params_of(SMALL["sparse_prefill"]), 1, "cpu")
    grown = _padded(kw, 4)
    assert grown["q"].shape[0] == 16 and torch.equal(grown["q"][4:8], kw["q"]) and torch.equal(grown["q"][:4], kw["q"])
    assert torch.equal(grown["indices"][:4], kw["indices"]) and (grown["indices"][4:] == -1).all()
    assert grown["topk_length"].shape == (16,) and grown["kv"] is kw["kv"] and grown["attn_sink"] is kw["attn_sink"]
    validate_case({**small_case("sparse_decode_fp8").to_dict(),
                   "params": {**small_case("sparse_decode_fp8").params, "capture": 4}})
    with pytest.raises(ValueError, match="capture"):
        validate_case({**small_case("sparse_decode_fp8").to_dict(),
                       "params": {**small_case("sparse_decode_fp8").params, "capture": 3}})
    assert {"unpadded", "padding"} <= set(get_spec(OP).checks)
    drawn = set()

    @settings(max_examples=40, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(get_spec(OP).strategy(get_profile("ci"), "sparse_decode_fp8"))
    def draw(case):
        drawn.add(case.params.get("capture", 1))

    draw()
    assert drawn == {1, 2, 4}


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["flash_mla", "triton"])
@pytest.mark.parametrize("capture", [2, 4])
def test_a_padded_capture_replays_the_real_rows_and_empty_padding(impl, capture):
    """Issue 48: captured at 2x / 4x the real batch, padding rows all -1: every replayed row bitwise
    the eager call on the padded problem, the real rows the eager call on them alone (split_kv's
    bounds: one bf16 ulp on the H100), the padding rows out 0 / lse +inf; a kernel that writes its
    padding rows fails `padding`."""
    for target in SMALL:
        case = Case(OP, {**small_case(target).params, "capture": capture}, 5)
        rows = evaluate(case, resolve_subject(OP, [impl], "cuda"), "cuda", source="test")
        print(f"{impl} {target} x{capture}: " + ", ".join(f"{r.tensor} {r.gate_metric} {r.value:.3g}/{r.bound:.3g}"
                                                           for r in rows))
        assert_holds(rows)
        assert {r.tensor for r in rows} >= {"unpadded.out", "unpadded.lse", "padding.out", "padding.lse"}
    # power-of-two scales: the wrapped Triton launch is exact on them without declaring bf16_dequant
    case = Case(OP, {**small_case("sparse_decode_fp8").params, "capture": capture, "scale_rule": "pow2"}, 5)
    rows = evaluate(case, resolve_subject(OP, ["sparse_decode_fp8=tests.hostile.graph:writes_padding_rows"], "cuda"),
                    "cuda", source="test")
    assert [r.tensor for r in rows if not r.passed] == ["padding.out"], [(r.tensor, r.reason) for r in rows]




def assert_holds(rows) -> None:
    bad = [f"{r.tensor}: {r.reason}" for r in rows if not r.passed]
    assert rows and not bad, bad
    assert {r.tensor for r in rows} >= {"replay.out", "replay.lse", "reference.out", "reference.lse"}
    assert all(r.metrics.mismatch_frac == 0 for r in rows if r.tensor.startswith("replay."))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["flash_mla", "triton"])
def test_flash_mla_and_triton_replay_bitwise_at_production_shapes_and_the_gpu_profile(impl):
    subject = resolve_subject(OP, [impl], "cuda")
    for case in production_cases("cuda_graph", list(get_spec(OP).targets)):
        rows = evaluate(case, subject, "cuda", source="test")
        print(f"{impl} {case.params['target']}: " + ", ".join(f"{r.tensor} {r.gate_metric} {r.value:.3g}/{r.bound:.3g}"
                                                            for r in rows))
        assert_holds(rows)
    for target in get_spec(OP).targets:
        seed = new_seed()
        result = fuzz(Campaign(OP, get_profile("gpu"), 4, seed, path=target),
                      each(lambda case, source: evaluate(case, subject, "cuda", source=source)))
        print(f"{impl} {target}: {result.examples} drawn cases, seed {seed}")
        assert result.failure is None, str(result.failure)


@pytest.mark.gpu
@pytest.mark.parametrize("h", GRAPH, ids=[h.impl.split(":")[1] for h in GRAPH])
def test_a_graph_unsafe_kernel_fails_its_case_and_the_next_one_passes(h):
    from mla_verify.equivalence.blocks import Judging
    from tests.isolated import judged

    target = h.impl.split("=")[0]
    worker = Judging("cuda", isolate=True, timeout=60.0)
    try:
        rows = judged(worker, small_case(target), [h.impl], h.impl)
        assert any(r.gate_metric == h.metric and h.says in r.reason for r in rows if not r.passed), \
            [(r.tensor, r.gate_metric, r.reason) for r in rows]
        print(f"{h.impl}: " + "; ".join(f"{r.tensor} {r.gate_metric}: {r.reason[:120]}" for r in rows if not r.passed))
        after = judged(worker, small_case(target, seed=6), ["triton"], "triton")
        assert after and all(r.passed for r in after), [(r.tensor, r.reason) for r in after]
    finally:
        worker.close()


@pytest.mark.gpu
@pytest.mark.parametrize("h", [GRAPH[0], GRAPH[-1]], ids=[h.impl.split(":")[1] for h in (GRAPH[0], GRAPH[-1])])
def test_a_graph_finding_is_saved_with_its_replay_seeds_and_replays(h, tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def cli(*argv: str) -> tuple[int, str]:
        done = subprocess.run([sys.executable, "-m", "mla_verify.cli", *argv], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
        return done.returncode, done.stdout + done.stderr

    code, text = cli("fuzz", "--op", OP, "--impl", h.impl, "--path", h.impl.split("=")[0], "--device", "cuda",
                     "--isolate", "--examples", "3", "--no-shrink", "--seed", "1", "--out", str(tmp_path / "run"))
    assert code == 1 and "Traceback" not in text, text
    saved = next(line.split("case saved: ")[1] for line in text.splitlines() if "case saved: " in line)
    case = json.loads(Path(saved).read_text())["case"]
    assert len(case["params"]["replay_seeds"]) == 3 and case["params"]["target"] == h.impl.split("=")[0]
    code, text = cli("replay", saved, "--impl", h.impl, "--device", "cuda", "--isolate")
    assert code == 1 and "reproduced" in text and "did NOT" not in text, text


@pytest.mark.parametrize("target", ["sparse_prefill", "sparse_decode_fp8", "forward_mqa"])
def test_the_captured_call_on_the_static_buffers_computes_each_replayed_problem(target):
    """On CPU, what a replay does without the graph: another seed's problem copied into the first
    one's buffers (the same layout), then the captured call (graph entries, the batch's req_id built
    beforehand) on them gives bit for bit the checked call's answer on that problem; Triton
    interpreted. Nothing else of a problem (host lists, config) differs between seeds."""
    from mla_verify.equivalence.properties.cuda_graph import FORMS, _graph_stages, _same_layout
    from mla_verify.equivalence.subject import stage_overrides
    from mla_verify.optimized import registry

    spec = get_spec(OP)
    overrides, _ = stage_overrides(["triton"], "cpu")

    @settings(max_examples=2, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=spec.strategy(TINY, target))
    def same(case):
        params = spec.params_of(case.params)
        stages = registry.resolve(spec.target(params).stages(params), "cpu", overrides)
        assert all(stages.chosen[s].graph is not None for s in spec.target(params).under_test)
        form = FORMS[target]
        static, other = (spec.target(params).inputs(params, s, "cpu") for s in (case.seed, params.replay_seeds[0]))
        want = form.eager(stages, other)
        _same_layout(form.buffers(static), form.buffers(other), params.replay_seeds[0])
        for name, t in form.buffers(other).items():
            form.buffers(static)[name].copy_(t)
        for a, b in zip(want, form.graph(_graph_stages(stages), static)):
            a, b = a.contiguous(), b.contiguous()  # decode's lse is a transposed view
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    same()


def test_the_judge_holds_each_replay_to_the_eager_answer_it_was_sent_with():
    """On CPU, the judge's side: the replayed outputs by name and each one's comparison with the eager
    call's answer cross the worker's message as data (a tensor handed twice crosses once; no
    "replay."/"eager." names read back); replays equal to the eager answers pass, and one element
    changed in an eager answer fails that replay's row alone."""
    import os
    import threading
    import time

    from mla_verify.equivalence.judge.rows import RowContext
    from mla_verify.equivalence.sandbox import wire
    from mla_verify.equivalence.sandbox.produced import Compared, Produced
    from mla_verify.equivalence.properties.cuda_graph import FORMS, _outputs, _stacked
    from mla_verify.equivalence.subject import stage_overrides
    from mla_verify.optimized import registry

    spec, case = get_spec(OP), small_case("sparse_decode_fp8")
    params = spec.params_of(case.params)
    target, form = spec.target(params), FORMS["sparse_decode_fp8"]
    stages = registry.resolve(target.stages(params), "cpu", stage_overrides(["torch-fp32"], "cpu")[0])
    answers = [_outputs(form.eager(stages, target.inputs(params, s, "cpu")), form.names) for s in params.replay_seeds]
    replayed = {n: _stacked([a[n] for a in answers]) for n in answers[0]}

    def judged(eager: dict) -> dict:
        produced = Produced([], tensors=replayed, stages=stages.pairs(),
                            compared=[Compared("replay", n, "exact", t, eager[n]) for n, t in replayed.items()])
        r, w = os.pipe()
        alive, _ = os.pipe()
        frames = wire.encode(*produced.to_header())
        threading.Thread(target=lambda: (wire.write(w, frames), os.close(w))).start()
        header, tensors = wire.Reader(r, alive).read(time.monotonic() + 60)
        assert len(tensors) == 2 * len(replayed)
        got = Produced.from_header(header, ())
        return {row.tensor: row for row in spec.judge_produced(case, got, RowContext(label="torch-fp32"))}

    rows = judged({n: t.clone() for n, t in replayed.items()})
    assert set(rows) == {"replay.out", "replay.lse", "reference.out", "reference.lse"}
    assert all(r.passed for r in rows.values()) and rows["replay.out"].check == "replay"
    assert rows["reference.out"].stages == (("sparse_decode_fp8", "torch-fp32"),)
    changed = {n: t.clone() for n, t in replayed.items()}
    changed["out"].view(-1)[7] += 1
    rows = judged(changed)
    assert [t for t, r in rows.items() if not r.passed] == ["replay.out"]
    assert rows["replay.out"].metrics.mismatch_frac > 0
