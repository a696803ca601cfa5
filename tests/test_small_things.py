"""What a newcomer expects in the first minutes (issue 29, item 7): a version, an API that `dir`
lists, "did you mean" for a misspelt name, a quiet interpreter, replay commands in JUnit."""

import os
import subprocess
import sys

import pytest

import mla_verify
from mla_verify.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_version_from_the_package_and_the_command_line(capsys):
    from importlib import metadata

    assert mla_verify.__version__ == metadata.version("mla-verify")
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mla-verify {mla_verify.__version__}"


def test_dir_lists_the_api_and_every_name_in_it_resolves():
    names = [n for n in dir(mla_verify) if not n.startswith("_")]
    for api in ("check", "assert_equivalent", "replay", "property_check", "drift", "strategies", "unsupported"):
        assert api in names
    for name in mla_verify.__all__:
        assert getattr(mla_verify, name) is not None


def test_drift_is_the_documented_call():
    from mla_verify import api

    assert mla_verify.drift is api.drift


@pytest.mark.parametrize("argv, message", [
    (["fuzz", "--op", "sparse_prefil"], "did you mean 'sparse_prefill'?"),
    (["gate", "--op", "sparse_decod_fp8"], "did you mean 'sparse_decode_fp8'?"),
    (["list", "--op", "sparse_decode_fp"], "did you mean 'sparse_decode_fp8'?"),
    (["fuzz", "--op", "sparse_prefill", "--impl", "trito"], "did you mean 'triton'?"),
    (["fuzz", "--op", "sparse_prefill", "--impl", "tests.impls.upstream.sparse_prefill"],
     "did you mean 'tests.impls.upstream:sparse_prefill'?"),
])
def test_a_misspelt_name_gets_the_closest_one(capsys, tmp_path, argv, message):
    code, text = run(capsys, *argv, "--device", "cpu", *(["--out", str(tmp_path / "run")] if argv[0] != "list" else []))
    assert code == 2 and message in text and len(text.strip().splitlines()) == 1


def test_the_interpreter_prints_no_runtime_warnings():
    """An empty row's LSE is log(0) = -inf by design; numpy under the interpreter warned about it
    in every gate's output."""
    script = ("import torch; from mla_verify.optimized.kernels.sparse_prefill import sparse_prefill\n"
              "q = torch.randn(2, 16, 576).bfloat16(); kv = torch.randn(8, 576).bfloat16()\n"
              "idx = torch.full((2, 128), -1, dtype=torch.int32); idx[0, :4] = torch.arange(4)\n"
              "out, lse, _ = sparse_prefill(q, kv, idx, 0.1)\n"
              "assert torch.isinf(lse[1]).all() and torch.isfinite(lse[0]).all()\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-W", "default", "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "RuntimeWarning" not in done.stderr


def test_junit_replay_commands_come_from_the_saved_case_files(tmp_path):
    from mla_verify.equivalence.cases.case import Case
    from mla_verify.fuzz import casefile
    from mla_verify.junit import saved_replays

    case = Case("quantize_fp8_ds_mla", {"n": 1, "value_regime": "normal", "scale_rule": "pow2"}, 3)
    mine = casefile.save(tmp_path / "a.json", casefile.CaseFile(case, ("tests.zoo.formats:divisor_224",), "cpu"))
    ours = casefile.save(tmp_path / "b.json", casefile.CaseFile(Case(case.op, case.params, 4), ("triton",), "cpu"))
    replays = saved_replays(tmp_path)
    assert replays["a.json"] == f"mla-verify replay {mine} --impl tests.zoo.formats:divisor_224 --device cpu"
    assert replays["b.json"] == f"mla-verify replay {ours} --device cpu"


def test_a_pipeline_pass_says_which_keywords_of_a_replaced_stage_it_never_passed():
    """forward_mqa never hands sparse_prefill an attention sink: a pass there says so (issue 29)."""
    result = mla_verify.check("forward_mqa", {"sparse_prefill": "torch-fp32"}, path="bf16", examples=2, seed=1,
                              device="cpu", profile="ci")
    assert result.passed
    assert "sparse_prefill: no case passed it attn_sink (check('sparse_prefill', ...) exercises them)" in result.notes
    assert not [n for n in mla_verify.check("sparse_prefill", "torch-fp32", examples=2, seed=1, device="cpu",
                                            profile="ci").notes if "no case passed it" in n]


def test_pickling_a_params_class_is_not_a_patch_of_the_judge():
    """The gate's dcp op failed every run with "replaced ...DcpParams.__slotnames__": pickling the
    params for the rank processes caches the class's slot names, which is Python, not the kernel."""
    import copyreg

    from mla_verify.equivalence.sandbox.guards import JudgeFunctions
    from mla_verify.equivalence.cases.params import DcpParams

    if "__slotnames__" in DcpParams.__dict__:
        delattr(DcpParams, "__slotnames__")
    saved = JudgeFunctions.now()
    copyreg._slotnames(DcpParams)  # what pickle.dumps of an instance does first
    assert saved.restore() == []
    DcpParams.evil = 1
    assert saved.restore() == ["mla_verify.equivalence.cases.params.DcpParams.evil"] and not hasattr(DcpParams, "evil")


def test_a_kept_watch_puts_back_each_calls_change_and_watches_judge_modules_imported_later(monkeypatch):
    """An isolation worker takes one Watch for all its cases: a call that patches the judge or the
    process fails, what it changed is put back for the next call, and a judge module imported
    after the watch was taken is watched from then on."""
    import sys
    import types

    import torch

    from mla_verify.equivalence.sandbox import guards
    from mla_verify.equivalence.sandbox.calls import Raised, call_implementation

    def patches():
        torch.sub = lambda *a, **k: None

    original = torch.sub
    with guards.kept_watch() as watch:
        with pytest.raises(Raised, match="replaced torch.sub"):
            call_implementation(patches, 1, "cpu")
        assert torch.sub is original and call_implementation(lambda: 7, 1, "cpu")[0] == 7
        with pytest.raises(Raised, match="changed process-wide state: torch default dtype"):
            call_implementation(lambda: torch.set_default_dtype(torch.float64), 1, "cpu")
        assert torch.get_default_dtype() == torch.float32
        late = types.ModuleType("mla_verify.equivalence.imported_late")
        late.judge = len
        monkeypatch.setitem(sys.modules, late.__name__, late)
        call_implementation(lambda: None, 1, "cpu")  # the import shows at the next put-back

        def patches_late():
            late.judge = max

        with pytest.raises(Raised, match="replaced mla_verify.equivalence.imported_late.judge"):
            call_implementation(patches_late, 1, "cpu")
        assert late.judge is len and guards.kept() is watch
    assert guards.kept() is None


def test_a_device_error_is_known_from_the_row_not_read_back_from_its_reason():
    """Issue 49: the driver and the worker retire a CUDA context on `Row.device_error`, set where
    the call's failure is known (`Raised`), never on a regex over the reason; the flag is not a
    stored column."""
    from mla_verify.equivalence.judge.rows import COLUMNS, FailureKind
    from mla_verify.equivalence.sandbox.produced import Produced
    from mla_verify.equivalence.sandbox.calls import Raised, raised_row, unsupported_row

    base = dict(run_id="r", case_id="c", op="sparse_prefill", path="sparse_prefill", impl="x", stages=(),
                device="cuda", seed=1, source="fuzz")
    after = raised_row(base, Raised(ValueError("bad"), device_error="an illegal memory access was encountered"))
    own = raised_row(base, Raised(RuntimeError("CUDA error: device-side assert triggered")))
    assert after.device_error and own.device_error
    assert not raised_row(base, Raised(ValueError("bad"))).device_error
    assert not unsupported_row(base, "unsupported: H=24").device_error
    assert after.gate_metric == FailureKind.RAISED and type(after.gate_metric) is str
    assert "device_error" not in COLUMNS and "device_error" not in after.to_record()
    assert Produced.failed_case(after).device_error
    assert not Produced.failed_case(raised_row(base, Raised(ValueError("bad")))).device_error
