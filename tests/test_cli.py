"""The command line as CI and users drive it: exit codes, saved cases that replay exactly."""

import json
import re

import pytest

from mla_verify.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_list_names_every_op_and_its_implementations(capsys):
    from mla_verify.equivalence.catalog import names

    code, text = run(capsys, "list", "--device", "cpu", "--tolerances")
    assert code == 0
    for op in names():
        assert op in text
    assert "bf16_units" in text and "bf16_cache_scale" in text


@pytest.mark.parametrize("argv, message", [
    (["fuzz", "--op", "no_such_op"], "unknown op"),
    (["fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "no_such_module:fn"], "cannot import"),
    (["fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.impls.misbehaving:wrong_signature"], "scale_rule"),
    (["fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "mla_verify.reference:no_such_fn"], "no attribute"),
    (["fuzz", "--op", "sparse_prefill", "--path", "bf16"], "--path applies"),
    (["fuzz", "--op", "forward_mqa", "--impl", "no_such_stage=reference:convert_index"], "unknown stage"),
    (["fuzz", "--op", "quantize_fp8_ds_mla", "--profile", "huge"], "unknown profile"),
])
def test_usage_errors_exit_2_with_one_line(capsys, tmp_path, argv, message):
    code, text = run(capsys, *argv, "--device", "cpu", "--out", str(tmp_path))
    assert code == 2 and message in text


def test_a_discrepancy_exits_1_saves_the_case_and_replays_exactly(capsys, tmp_path):
    code, text = run(capsys, "fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.zoo.formats:divisor_224",
                     "--examples", "20", "--seed", "5", "--device", "cpu", "--out", str(tmp_path), "--profile", "ci",
                     "--junit", str(tmp_path / "j.xml"))
    assert code == 1 and "DISCREPANCY" in text and "seed 5" in text
    saved = next(line.split("case saved: ")[1] for line in text.splitlines() if "case saved: " in line)
    junit = (tmp_path / "j.xml").read_text()  # the CI's failure says how to replay it (issue 29)
    assert 'failures="1"' in junit and f"replay: mla-verify replay {saved} --impl tests.zoo.formats:divisor_224" in junit
    assert "quantize_fp8_ds_mla-tests.zoo.formats_divisor_224-" in saved  # op and implementation in its name
    failure = json.loads(open(saved).read())["failure"]
    code, text = run(capsys, "replay", saved, "--device", "cpu")
    assert code == 2 and "--impl tests.zoo.formats:divisor_224" in text  # a saved MODULE:CALLABLE is never imported
    code, text = run(capsys, "replay", saved, "--device", "cpu", "--impl", "tests.zoo.formats:divisor_224")
    assert code == 1 and f"{failure[0]['value']:.4g}" in text  # the same metric value, exactly
    assert "reproduced: same failing tensors and metrics, same values" in text
    code, text = run(capsys, "replay", str(saved), "--device", "cpu", "--impl", "mla_verify.reference:quantize_fp8_ds_mla")
    assert code == 0
    assert (tmp_path / "rows.parquet").exists() and (tmp_path / "meta.json").exists()


def test_a_correct_implementation_passes_and_the_report_builds(capsys, tmp_path):
    code, text = run(capsys, "fuzz", "--op", "convert_index", "--impl", "mla_verify.reference:convert_index", "--examples", "15",
                     "--device", "cpu", "--out", str(tmp_path), "--profile", "ci", "--junit", str(tmp_path / "j.xml"))
    assert code == 0 and "PASS: 15 examples" in text
    assert 'failures="0"' in (tmp_path / "j.xml").read_text()
    code, text = run(capsys, "report", str(tmp_path), "--markdown", str(tmp_path / "r.md"))
    assert code == 0 and (tmp_path / "report.html").exists() and "convert_index" in (tmp_path / "r.md").read_text()


def test_gate_in_parallel_parts_merges_every_part_into_one_run(capsys, tmp_path):
    ops = ["concat_mla_q", "split_prefill_chunks", "reshape_query_for_spec_decode"]
    code, text = run(capsys, "gate", "--device", "cpu", "--parallel", "2", "--examples", "2", "--seed", "4",
                     "--out", str(tmp_path), *[a for op in ops for a in ("--op", op)])
    assert code == 0 and "2 parts" in text
    from mla_verify import reports

    frame, _ = reports.load_run(tmp_path)
    assert set(frame.op) == set(ops) and (tmp_path / "part-0").is_dir() and (tmp_path / "part-1").is_dir()
    assert (tmp_path / "report.html").exists()


def test_fuzz_in_parallel_campaigns_merges_rows_and_keeps_each_failure_replayable(capsys, tmp_path):
    from mla_verify.runs.parts import share

    assert share(10, 3) == [4, 3, 3] and share(2, 4) == [1, 1]
    code, text = run(capsys, "fuzz", "--op", "convert_index", "--parallel", "2", "--examples", "6", "--seed", "3",
                     "--device", "cpu", "--profile", "ci", "--out", str(tmp_path / "ok"))
    # each campaign runs its whole covering set (its pairs pass the 3 examples a campaign)
    assert code == 0 and "seed 3 x 3, seed 4 x 3" in text and re.search(r"PASS: \d+ examples over 2 campaigns", text)
    from mla_verify import reports

    frame, _ = reports.load_run(tmp_path / "ok")
    assert frame.case_id.nunique() >= 2 and set(frame.op) == {"convert_index"}
    code, text = run(capsys, "fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.zoo.formats:divisor_224",
                     "--parallel", "2", "--examples", "20", "--seed", "5", "--device", "cpu", "--profile", "ci",
                     "--out", str(tmp_path / "bad"))
    assert code == 1 and text.count("DISCREPANCY") == 2
    for part in ("part-0", "part-1"):
        saved = sorted((tmp_path / "bad" / part / "failures").glob("*.json"))
        assert saved, f"{part} saved no case"
        for case_file in saved:
            assert run(capsys, "replay", str(case_file), "--device", "cpu", "--impl", "tests.zoo.formats:divisor_224")[0] == 1


def test_reference_memory_reaches_every_reference_call(capsys, tmp_path, monkeypatch):
    from mla_verify.reference import streaming

    monkeypatch.delenv(streaming.MEMORY_ENV, raising=False)  # restored after the test: main() sets it
    seen = []
    real = streaming.chunk_tokens

    def spy(num_heads, topk, itemsize, budget_bytes, *rest):
        seen.append(budget_bytes)
        return real(num_heads, topk, itemsize, budget_bytes, *rest)

    monkeypatch.setattr(streaming, "chunk_tokens", spy)
    code, text = run(capsys, "fuzz", "--op", "sparse_decode_fp8", "--impl", "torch-fp32", "--examples", "3", "--seed", "2",
                     "--device", "cpu", "--out", str(tmp_path), "--profile", "ci", "--reference-memory", "96MiB")
    assert code == 0, text
    assert seen and set(seen) == {96 << 20}


@pytest.mark.parametrize("size", ["lots", "1MiB", "-4GiB"])
def test_a_reference_memory_that_is_no_size_or_too_small_is_a_usage_error(capsys, size):
    assert main(["fuzz", "--op", "sparse_decode_fp8", "--reference-memory", size]) == 2
    assert "--reference-memory" in capsys.readouterr().err


def test_list_says_which_implementation_each_stage_gets_here(capsys):
    code, text = run(capsys, "list", "--device", "cpu")
    assert code == 0
    block = text.split("\nconvert_index  [convert_index]")[1].split("\n\n")[0]
    assert "triton       available, interpreted on cpu: by name only" in block
    assert "torch-fp32   available, default here" in block


# ----------------------------------------------------------------------------- help that teaches

COMMANDS = ("list", "fuzz", "replay", "gate", "report", "bench")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_help_has_a_description_exit_codes_and_two_examples(capsys, command):
    code, text = run(capsys, command, "--help")
    assert code == 0
    description = text.split("\n\n")[1]
    assert not description.startswith(("options:", "positional")) and len(description) > 100, description
    codes = text.split("exit codes:\n")[1].split("\n\n")[0]
    assert codes.startswith("  0 ") and "\n  2 " in codes
    examples = text.split("examples:\n")[1]
    assert examples.count(f"\n  mla-verify {command} ") + examples.startswith(f"  mla-verify {command} ") == 2
    assert max(len(line) for line in text.splitlines()) <= 100


def test_the_top_level_help_says_what_the_tool_does_not_where_its_source_lives(capsys):
    code, text = run(capsys, "--help")
    assert code == 0 and "float64 reference" in text and "exit codes:" in text and "examples:" in text
    assert "thin layer" not in text and "equivalence/" not in text
    for command in COMMANDS:
        assert f"\n    {command} " in text


def test_fuzz_help_shows_defaults_and_explains_junit(capsys):
    text = run(capsys, "fuzz", "--help")[1]
    assert "default 300" in text and "runs/fuzz-OP-IMPL-TIME" in text
    assert "--junit FILE" in text and "JUnit XML" in text


@pytest.mark.parametrize("long", [False, True])
def test_list_fits_100_columns_and_long_gives_the_full_reasons(capsys, long):
    from mla_verify.equivalence.judge.policy import LSE_BOUNDS

    code, text = run(capsys, "list", "--device", "cpu", "--tolerances", "--deviations", *["--long"] * long)
    assert code == 0
    too_wide = [line for line in text.splitlines() if len(line) > 100]
    assert not too_wide, too_wide
    reason = LSE_BOUNDS[0].reason
    flat = " ".join(text.split())
    assert (reason in flat) == long and reason[:30] in flat


def test_list_shows_each_ops_keywords(capsys):
    from mla_verify.equivalence.catalog import specs

    text = run(capsys, "list", "--device", "cpu")[1]
    for spec in specs("op"):
        name = spec.name
        block = " ".join(text.split(f"\n{name}  [")[1].split("\n\n")[0].split())
        assert f"keywords: {', '.join(spec.arguments)}" in block, name


def test_list_op_prints_the_call_with_shapes_dtypes_returns_and_bounds(capsys):
    code, text = run(capsys, "list", "--device", "cpu", "--op", "sparse_prefill")
    assert code == 0
    for line in ("q=bfloat16[T=", "kv=bfloat16[N=", "indices=int32[T=", "sm_scale=float ",
                 "returns: (out, lse[, max_logits])", "lse_fp32_units <= 64", "bf16_units <= 6"):
        assert line in text, line
    assert "torch-fp32" in text  # the implementations here


@pytest.mark.parametrize("op", ["sparse_prefill", "sparse_decode_fp8", "forward_mqa", "dcp_merge"])
def test_list_op_shows_one_case_whose_sizes_are_its_tensors(capsys, op):
    """Issue 29: the header said tokens=3, heads=8 while topk_length was int32[tokens=4] and
    attn_sink float32[heads=16] (borrowed from another pinned case). Issue 38: dimensions are
    labelled with the contract's own names (T, H, K, ...), not by matching sizes, and a name
    stands for one size throughout the call."""
    code, text = run(capsys, "list", "--device", "cpu", "--op", op)
    assert code == 0
    call = text.split("  call: impl(")[1].split("  )")[0]
    labels = re.findall(r"[\[ ]([A-Z]{1,2})=(\d+)[,\]]", call)
    assert labels, call
    sizes: dict = {}
    for name, size in labels:
        assert sizes.setdefault(name, size) == size, (name, size, call)


def test_list_op_labels_each_bound_with_its_tensor_and_says_when_one_scales(capsys):
    code, text = run(capsys, "list", "--device", "cpu", "--op", "sparse_prefill")
    assert "      max_logits (the lse bounds): lse_fp32_units <= 64" in text
    assert "\n      lse: lse_fp32_units" in text and "\n      out: bf16_units" in text
    assert re.search(r"abs_mean_err <= max\(0\.001, 5 \* 2\^-9 / sqrt\(rows\)\)\s+= [\d.]+ at its \d+ rows", text)


def test_list_op_shows_every_keyword_each_op_receives(capsys):
    from mla_verify.equivalence.catalog import specs

    for spec in specs("op"):
        name = spec.name
        code, text = run(capsys, "list", "--device", "cpu", "--op", name)
        assert code == 0 and "compared with the reference" in text, name
        for keyword in spec.arguments:
            assert re.search(rf"\b{keyword}[=,)]", text), (name, keyword)


def test_list_op_of_a_property_shows_each_check_and_what_it_is_held_to(capsys):
    code, text = run(capsys, "list", "--device", "cpu", "--op", "property:determinism")
    assert code == 0 and "rerun: bit for bit" in text
    assert run(capsys, "list", "--op", "no_such_op")[0] == 2


def test_fuzz_help_names_every_forward_mqa_path(capsys):
    from mla_verify.equivalence.cases.draws import FORWARD_PATHS

    assert main(["fuzz", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert all(path in text for path in FORWARD_PATHS), [p for p in FORWARD_PATHS if p not in text]


# ----------------------------------------------------------------------------- a device that is not there

NO_GPU = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a CUDA GPU")


@NO_GPU
@pytest.mark.parametrize("argv", [["gate"], ["fuzz", "--op", "sparse_prefill"], ["replay", "fuzz/corpus/concat_mla_q.json"],
                                  ["bench", "--quick"]])
def test_device_cuda_without_a_gpu_is_a_usage_error_in_one_line(capsys, tmp_path, argv):
    """Issue 29: the gate printed a worker traceback, waited 300 s and exited 3 with a run directory."""
    out = tmp_path / "run"
    code, text = run(capsys, *argv, "--device", "cuda", *(["--out", str(out)] if argv[0] != "replay" else []))
    assert code == 2
    assert text.strip().splitlines() == ["mla-verify: device cuda asked for, but no CUDA GPU is visible"]
    assert not out.exists()


@NO_GPU
def test_check_without_a_gpu_raises_a_usage_error():
    import mla_verify

    with pytest.raises(mla_verify.UsageError, match="no CUDA GPU is visible"):
        mla_verify.check("sparse_prefill", device="cuda", examples=1)


@NO_GPU
def test_list_for_cuda_on_a_cpu_machine_calls_nothing_available(capsys):
    code, text = run(capsys, "list", "--device", "cuda", "--op", "sparse_prefill")
    assert code == 0
    impls = text.split("implementations (--impl NAME):")[1]
    assert "available" not in impls.replace("unavailable", "")
    assert "triton       unavailable: no CUDA GPU is visible" in impls


def test_a_gate_that_fails_itself_exits_3_and_its_traceback_is_where_the_message_says(capsys, tmp_path, monkeypatch):
    """Issue 29: the message named a harness-error.txt that did not exist (and a bare TypeError exited 1)."""
    import mla_verify.runs.driver

    def broken(*args, **kwargs):
        raise TypeError("Compared.__init__() missing 1 required positional argument: 'base'")

    monkeypatch.setattr(mla_verify.runs.driver, "run_units", broken)
    code, text = run(capsys, "gate", "--device", "cpu", "--out", str(tmp_path / "run"))
    assert code == 3 and "harness-error.txt" in text and "TypeError" in text
    assert "missing 1 required positional argument" in (tmp_path / "run" / "harness-error.txt").read_text()
