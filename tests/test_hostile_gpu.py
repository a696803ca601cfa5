"""On a GPU: kernels that take the CUDA context down or hang it (tests/hostile/cuda.py) fail their
case in the isolation worker, which is replaced; the correct case after each runs in a fresh
worker and passes, never reported hung. The campaign that shrinks a device-side assert to its
smallest case is `scripts/gpu_lane.sh hostile` (scripts/hostile_gpu.py): minutes, not a unit test."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mla_verify.equivalence.cases.case import Case
from tests.hostile import CUDA

REPO = Path(__file__).resolve().parent.parent
PREFILL = {"heads": 64, "kv_rows": 300, "topk": 128, "value_regime": "normal", "sm_scale": 0.1, "invalid": [],
           "topk_length": "none", "sink": "none"}
DECODE = {"batch": 2, "s_q": 1, "heads": 64, "topk": 64, "seq_lens": [100, 40], "page_size": 64, "stride_pad": 0,
          "value_regime": "normal", "scale_rule": "pow2", "sm_scale": 0.1, "invalid": []}


def case(op: str, tokens: int) -> Case:
    return Case(op, {**PREFILL, "tokens": tokens} if op == "sparse_prefill" else DECODE, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("h", CUDA, ids=[h.impl.split(":")[1] for h in CUDA])
def test_a_kernel_that_kills_or_hangs_the_context_fails_its_case_and_the_next_one_passes(h):
    from mla_verify.equivalence.blocks import Judging
    from tests.isolated import judged

    worker = Judging("cuda", isolate=True, timeout=10.0)
    try:
        rows = judged(worker, case(h.op, 4), [h.impl], h.impl)
        assert any(r.gate_metric == h.metric and h.says in r.reason for r in rows if not r.passed), \
            [(r.gate_metric, r.reason) for r in rows]
        # The next case, a correct implementation in the same Worker, runs in a fresh process and passes.
        after = judged(worker, case(h.op, 1), ["torch-fp32"], "torch-fp32")
        assert after and all(r.passed for r in after), [(r.gate_metric, r.reason) for r in after]
    finally:
        worker.close()


@pytest.mark.gpu
def test_without_isolation_a_cuda_error_ends_the_campaign_with_the_case_saved(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "mla_verify.cli", "fuzz", "--op", "sparse_prefill", "--impl",
                           "tests.hostile.cuda:assert_on_three_tokens", "--no-isolate", "--device", "cuda",
                           "--examples", "20", "--seed", "1", "--out", str(tmp_path / "run")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    text = done.stdout + done.stderr
    assert done.returncode == 1 and "the CUDA context is unusable" in text and "Traceback" not in text, text
    assert list((tmp_path / "run" / "failures").glob("*.json")) and (tmp_path / "run" / "rows.parquet").exists()


@pytest.mark.gpu
def test_the_cpu_zoo_fails_isolated_on_the_gpu_where_the_parent_judges():
    """Every kernel of tests/hostile/cpu.py on CUDA inputs in a CUDA worker: the worker calls it,
    the parent builds the reference on the GPU and judges (mkldnn is a CPU layout: not here)."""
    from mla_verify.equivalence.blocks import Judging
    from tests.isolated import judged
    from tests.hostile import CPU
    from tests.test_hostile import CASES

    worker = Judging("cuda", isolate=True, timeout=10.0)
    try:
        for h in (h for h in CPU if "mkldnn" not in h.impl):
            rows = judged(worker, Case(h.op, CASES[h.op], 3), [h.impl], h.impl)
            want, says = h.outcome(isolated=True)
            says = says.replace("the contract says cpu", "the contract says cuda")  # meta_out
            assert any(r.gate_metric == want and says in r.reason for r in rows if not r.passed), \
                (h.impl, [(r.gate_metric, r.reason) for r in rows])
    finally:
        worker.close()


@pytest.mark.gpu
def test_a_cuda_worker_stands_behind_the_sandbox_and_every_kernel_reaching_outside_fails_its_case():
    """Issue 45, item 4: the sandbox's and the worker-boundary kernels (tests.hostile.SANDBOX,
    BOUNDARY) in a CUDA worker, each with its CPU outcome; the layers that held are printed."""
    from mla_verify.equivalence.blocks import Judging
    from tests.isolated import judged
    from tests.hostile import BOUNDARY, SANDBOX
    from tests.test_hostile import CASES

    worker = Judging("cuda", isolate=True, timeout=10.0)
    try:
        print(f"cuda worker: {worker.start().summary()}")
        # a write hidden from the worker's own snapshot is caught where inputs are handed over (CPU) only
        for h in [*SANDBOX, *(h for h in BOUNDARY if "hides_it" not in h.impl)]:
            start = time.monotonic()
            rows = judged(worker, Case(h.op, CASES[h.op], 3), [h.impl], h.impl)
            assert any(r.gate_metric == h.metric and h.says in r.reason for r in rows if not r.passed), \
                (h.impl, [(r.gate_metric, r.reason) for r in rows])
            assert time.monotonic() - start < 60, f"{h.impl}: the judge waited for the timeout, not the worker"
    finally:
        worker.close()


@pytest.mark.gpu
def test_a_cuda_kernel_that_kills_its_parent_only_fails_its_case(tmp_path):
    """Issue 45, item 4: on CUDA the worker is the judge's own child: SIGKILL to its parent killed
    the judge (exit 137, no case saved, no row). Behind the sandbox it is refused."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "mla_verify.cli", "fuzz", "--op", "quantize_fp8_ds_mla", "--impl",
                           "tests.hostile.sandbox:kills_its_judge", "--device", "cuda", "--examples", "2", "--seed", "1",
                           "--no-shrink", "--out", str(tmp_path / "run")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode == 1 and "DISCREPANCY" in text, text
    assert list((tmp_path / "run" / "failures").glob("*.json")) and (tmp_path / "run" / "rows.parquet").exists()
