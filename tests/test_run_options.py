"""Issue 49: the CLI and check()/gate() handed their arguments to `runs.plan.Options` by matching
names (`vars(args)`, `{**locals()}`), which dropped a misspelled or new name silently. Every name is
now an Options field, translated on the way, or declared the caller's own; any other fails loudly."""

import argparse
import dataclasses
from pathlib import Path

import pytest

from mla_verify import cli
from mla_verify.runs.plan import Options

FIELDS = {f.name for f in dataclasses.fields(Options)}
FUZZ = ["fuzz", "--op", "sparse_decode_fp8", "--impl", "torch-fp32", "--examples", "3", "--seed", "5",
        "--timeout", "9", "--sandbox", "off", "--deviation", "fp8_scale_rounding", "--convention", "lse_base=2",
        "--no-shrink", "--path", "bf16", "--world-size", "2", "--shard", "1/2", "--parallel", "2",
        "--profile", "ci", "--no-isolate", "--corpus", "kept", "--junit", "j.xml", "--baseline", "b", "--out", "o"]
GATE = ["gate", "--op", "sparse_decode_fp8", "--impl", "sparse_decode_fp8=torch-fp32", "--examples", "3",
        "--seed", "5", "--timeout", "9", "--sandbox", "strict", "--durations", "d.json", "--parallel", "2",
        "--shard", "0/2", "--profile", "ci", "--isolate", "--corpus", "kept", "--junit", "j.xml", "--out", "o"]


@pytest.mark.parametrize("argv", [FUZZ, GATE], ids=["fuzz", "gate"])
def test_every_run_argument_reaches_its_option_or_is_the_clis_own(argv):
    args = cli.build_parser().parse_args(argv)
    dests = set(vars(args))
    assert dests <= FIELDS | set(cli.TRANSLATED) | set(cli.CLI_ONLY), sorted(dests - FIELDS)
    assert not (set(cli.TRANSLATED) | set(cli.CLI_ONLY)) & FIELDS  # a translated name is no field of its own
    options = cli._run_options(args, "cpu")
    for name in dests & FIELDS - {"device"}:
        assert getattr(options, name) == getattr(args, name), name
    assert options.device == "cpu" and options.command == argv[0]
    if argv is FUZZ:
        assert (options.ops, options.specs, options.impls) == (("sparse_decode_fp8",), ("torch-fp32",), ())
        assert (options.deviations, options.conventions, options.shrink) == (("fp8_scale_rounding",),
                                                                            ("lse_base=2",), False)
    else:
        assert (options.ops, options.specs, options.impls) == (("sparse_decode_fp8",), (),
                                                               ("sparse_decode_fp8=torch-fp32",))
        assert options.durations == Path("d.json") and options.isolate is True


def test_an_argument_without_an_option_fails_loudly():
    args = cli.build_parser().parse_args(["gate"])
    stray = argparse.Namespace(**vars(args), exampels=3)
    with pytest.raises(TypeError, match="exampels"):
        cli._run_options(stray, "cpu")
    with pytest.raises(TypeError, match="exampels"):
        Options.asked("gate", {"examples": 3, "exampels": 3})
    assert Options.asked("gate", {"examples": 3, "log": print}, besides=("log",)).examples == 3
