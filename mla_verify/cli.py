"""`mla-verify`: the command-line tool, a thin layer over the Python API (`mla_verify.api`) and
the gate, report and bench modules.

Exit codes (for CI): 0 = no discrepancy; 1 = a discrepancy, crash, hang or broken contract of the
implementation (or drift against a baseline); 2 = usage error or bad input (or a baseline with
nothing comparable), with a one-line reason; 3 = mla-verify itself failed (the traceback is saved
in the run directory); 130 = interrupted (Ctrl-C or SIGTERM: the current case finished, the run written,
failures' replay commands printed); 141 = the output pipe closed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import textwrap
import time
from dataclasses import fields
from pathlib import Path

def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _prepare(device: str) -> None:
    """Triton decides interpreter vs compiler when kernels are defined: set it before importing them."""
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Epilogs keep their layout; an option's default is shown unless its help states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


TOOL = ("Checks implementations of DeepSeek-style sparse MLA attention (the kernels of vLLM's FlashMLA "
        "sparse backend) against an exact float64 reference: it fuzzes inputs, compares outputs and "
        "log-sum-exps within stated bounds, saves the smallest failing case for an exact replay, and "
        "writes numerical-drift reports.")

# Exit codes, shared by the subcommands that can end that way.
DISCREPANCY = ("1", "a discrepancy, crash, hang, flaky result or broken contract of the implementation; "
                    "the failing case is saved and its replay command printed")
USAGE = ("2", "usage error or bad input, with a one-line reason, before any case runs")
HARNESS = ("3", "mla-verify itself failed (the traceback is in the run directory's harness-error.txt)")
NO_VERDICT = ("4", "NO VERDICT: nothing judged what was asked (every case declined or not judged, a replaced stage "
                   "never called, a baseline with nothing compared under --fail-on); the line starting "
                   "`NO VERDICT:` says why")
INTERRUPTED = ("130", "Ctrl-C or SIGTERM: the current case finishes, the run is written, failures' replay "
                      "commands printed")


def _epilog(codes: list[tuple[str, str]], examples: list[tuple[str, str]]) -> str:
    lines = ["exit codes:"]
    for code, meaning in codes:
        lines += textwrap.wrap(meaning, 98, initial_indent=f"  {code:<5}", subsequent_indent=" " * 7)
    lines += ["", "examples:"]
    for command, what in examples:
        shell = textwrap.wrap(command, 94, initial_indent="  ", subsequent_indent="      ", break_long_words=False,
                              break_on_hyphens=False)
        lines += [*(line + " \\" for line in shell[:-1]), shell[-1],
                  *textwrap.wrap(what, 98, initial_indent=" " * 6, subsequent_indent=" " * 6)]
    return "\n".join(lines)


def _command(sub, name: str, summary: str, description: str, epilog: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=summary, description=textwrap.fill(description, 98, break_on_hyphens=False),
                          epilog=epilog, formatter_class=_Formatter)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _shard(text: str):
    from mla_verify.runs.parts import Shard

    try:
        return Shard.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_shard(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--shard", type=_shard, default=None, metavar="I/N|auto",
                   help=f"run only shard I of N (0 <= I < N): {what}; `mla-verify merge` joins the N run "
                        "directories into one run. auto: the scheduler's own index and count (Slurm "
                        "SLURM_ARRAY_TASK_ID/_COUNT, Kubernetes JOB_COMPLETION_INDEX, Buildkite "
                        "BUILDKITE_PARALLEL_JOB/_COUNT, GitLab, CircleCI, else MLA_VERIFY_SHARD_INDEX/_COUNT; "
                        "default: the whole run)")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the cases run (default: cuda when present, else cpu)")
    p.add_argument("--judge", choices=("auto", "fused", "eager"), default=None,
                   help="what measures attention outputs: the fused judge (one Triton pass), or the eager one, its "
                        "reference, which always measures and describes a failure (default auto: fused on cuda)")


def _add_isolation(p: argparse.ArgumentParser) -> None:
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="run cases in a worker process replaced after a crash, hang or CUDA error, judged in this one "
                        "out of the kernel's reach (default: on, on cpu as on cuda; --no-isolate judges in the "
                        "kernel's own process and its PASS says so)")
    p.add_argument("--timeout", type=_positive_float, default=None, metavar="S",
                   help="seconds the implementation may take per case in the worker (start-up and the reference "
                        "are not counted; default 300); not with --no-isolate: an in-process call "
                        "cannot be stopped")
    p.add_argument("--sandbox", choices=("auto", "strict", "off"), default="auto",
                   help="the OS boundary each isolation worker puts itself behind before any of the kernel's code "
                        "runs (Landlock, seccomp, a user namespace, no_new_privs, its own session): auto sets up "
                        "what this host allows and the PASS line names what held; strict refuses to run where a "
                        "layer cannot be set up; off runs the worker as this process's user, unconfined")


def _add_deviation(p: argparse.ArgumentParser, default: list | None) -> None:
    p.add_argument("--deviation", action="append", default=default, metavar="NAME",
                   help="a documented deviation the --impl callable has (repeatable; `mla-verify list --deviations`); "
                        "its bounds replace the exact ones where it applies"
                        + ("" if default is not None else " (default: the ones saved with the case)"))


def _add_convention(p: argparse.ArgumentParser, default: list | None) -> None:
    p.add_argument("--convention", action="append", default=default, metavar="KEY=VALUE",
                   help="a convention of the --impl callable that is not the reference's (repeatable): lse_base=2, "
                        "empty_lse=-inf, max_logits_base=2; its outputs are converted to the reference's as it "
                        "returns them" + ("" if default is not None else " (default: the ones saved with the case)"))


MIN_REFERENCE_MEMORY = 64 << 20
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}


def memory_size(text: str) -> int:
    """'4GiB', '512MiB', '1.5G' or a number of bytes -> bytes."""
    number = text.strip().rstrip("bBiIkKmMgG")
    unit = text.strip()[len(number):].lower()
    try:
        size = int(float(number) * _UNITS[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4GiB, 512MiB or a number of bytes") from None
    if size < MIN_REFERENCE_MEMORY:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 64MiB (one query token at 128 heads and top-k 2048 "
                                         "takes 17 MiB)")
    return size


def _factor(text: str) -> float:
    value = float(text)
    if not (value > 1 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a number > 1, got {text}")
    return value


def _confidence(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def _add_drift(p: argparse.ArgumentParser, pair: bool = True) -> None:
    from mla_verify.equivalence.judge import policy

    p.add_argument("--factor", type=_factor, default=policy.DRIFT_FACTOR,
                   help=f"drift: a metric grew beyond this many times the baseline's (default {policy.DRIFT_FACTOR:g})")
    p.add_argument("--confidence", type=_confidence, default=policy.DRIFT_CONFIDENCE,
                   help=f"drift: confidence of the unpaired rank test and of the bias t intervals "
                        f"(default {policy.DRIFT_CONFIDENCE:g})")
    p.add_argument("--min-cases", type=_positive_int, default=policy.DRIFT_MIN_CASES,
                   help="drift: fewer cases a side and no case shared with the baseline is 'too few cases to "
                        f"judge' (default {policy.DRIFT_MIN_CASES})")
    if pair:   # history pairs by name, or one implementation per op and run
        p.add_argument("--pair", action="append", default=[], metavar="NEW=OLD",
                       help="drift: compare implementation NEW of this run with OLD of the baseline (repeatable; "
                            "default: same names, or the one implementation per op of each run)")
    p.add_argument("--fail-on", choices=("drifted", "worse"), default=None,
                   help="drift: the word that fails the run (exit 1): drifted (beyond --factor, the default) or "
                        "worse (significantly worse within the factor, or drifted); given, a baseline with "
                        "nothing compared fails too (exit 4, NO VERDICT)")


def _drift_settings(args):
    """--factor, --confidence, --min-cases, --pair and --fail-on, as fuzz, gate and report share them."""
    from mla_verify.reports.drift import DriftSettings
    from mla_verify.reports.pairing import parse_pairs

    return DriftSettings(args.factor, args.confidence, args.min_cases, parse_pairs(list(args.pair)),
                         args.fail_on or "drifted")


def _add_corpus(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", type=Path, default=None, metavar="DIR",
                   help="a kept corpus (plain JSON files a CI cache or a repository keeps): its cases of these "
                        "implementations run first, whatever the seed; every finding is added, minimized and named "
                        "by its content (a rerun adds no duplicate) (default: none)")


def _add_reference_memory(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reference-memory", type=memory_size, default=None, metavar="SIZE",
                   help="working memory each reference call may hold, e.g. 2GiB (default 4GiB); "
                        "large cases run in more, smaller chunks")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mla-verify", description=textwrap.fill(TOOL, 98, break_on_hyphens=False),
                     formatter_class=_Formatter, epilog=_epilog(
        [("0", "no discrepancy (and no drift beyond the factor)"), DISCREPANCY, USAGE, HARNESS, NO_VERDICT,
         INTERRUPTED],
        [("mla-verify fuzz --op sparse_decode_fp8 --impl mykernels.decode:sparse_decode",
          "fuzz your own decode kernel against the reference"),
         ("mla-verify gate --device cpu", "the CI gate: every op and path, every implementation available here")])
        + "\n\n" + textwrap.fill("`mla-verify COMMAND --help` explains each command. From Python or pytest: "
                                 "`import mla_verify` (check, assert_equivalent, replay, property_check).", 98))
    from mla_verify import _version

    parser.add_argument("--version", action="version", version=f"mla-verify {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_list_command(sub)
    _add_fuzz_command(sub)
    _add_replay_command(sub)
    _add_gate_command(sub)
    _add_merge_command(sub)
    _add_report_command(sub)
    _add_history_command(sub)
    _add_bench_command(sub)
    return parser


def _add_list_command(sub) -> None:
    """`mla-verify list` and its options."""
    p = _command(sub, "list", "ops, their keywords, implementations here, tolerances and deviations",
                 "List every op of the contract (the keyword arguments an implementation receives, its "
                 "reference), every pipeline stage and property, and which implementations run on this "
                 "device. --op OP shows one op's full contract: the call with shapes and dtypes, what "
                 "is returned and compared, and each bound.",
                 _epilog([("0", "listed"), ("2", "an unknown --op")],
                         [("mla-verify list --op sparse_prefill",
                           "the call your prefill kernel gets, its return value and the bounds it is held to"),
                          ("mla-verify list --tolerances --long", "every bound, with the measured reason for it")]))
    _add_common(p)
    p.add_argument("--op", default=None, metavar="OP",
                   help="show only this op (or property:NAME): its call with shapes and dtypes, returns, bounds")
    p.add_argument("--tolerances", action="store_true", help="also print every bound of the tolerance policy")
    p.add_argument("--long", action="store_true", help="with --tolerances: each bound's reason in full")
    p.add_argument("--deviations", action="store_true",
                   help="also print each documented deviation a kernel may declare (--deviation): meaning and bounds")
    p.add_argument("--coverage", action="store_true",
                   help="with --op: per profile, the features its campaigns' first cases hit and how often random draws hit each")
    p.add_argument("--draws", type=int, default=1000, metavar="N", help="with --coverage: random draws per profile")
    p.add_argument("--path", default=None, help="with --coverage: a forward_mqa path (default: the unrestricted draw)")


def _add_fuzz_command(sub) -> None:
    """`mla-verify fuzz` and its options."""
    p = _command(sub, "fuzz", "fuzz one op, pipeline or property against the reference",
                 "Draw cases of one op with Hypothesis, run the implementation and the float64 reference on "
                 "each, and compare every returned tensor within its bound (`mla-verify list --op OP`). The "
                 "first failing case is shrunk to the smallest one that still fails, saved as JSON under "
                 "the run directory, and printed with the `mla-verify replay` command that reproduces it. "
                 "Every compared tensor of every case is a row of the run's rows.parquet / rows.csv.",
                 _epilog([("0", "every case passed"), DISCREPANCY, USAGE, HARNESS, NO_VERDICT, INTERRUPTED],
                         [("mla-verify fuzz --op sparse_prefill --impl mykernels.prefill:sparse_prefill "
                           "--examples 50 --seed 1",
                           "50 cases for your prefill kernel (a module-level function taking the keywords "
                           "`mla-verify list --op sparse_prefill` shows), repeatable with seed 1"),
                          ("mla-verify fuzz --op forward_mqa --path fp8_mixed "
                           "--impl sparse_decode_fp8=mykernels.decode:sparse_decode --deviation bf16_dequant",
                           "your decode kernel as one stage of the whole forward_mqa, declaring that it "
                           "rounds dequantized rows to bf16")]))
    _add_common(p)
    _add_isolation(p)
    _add_reference_memory(p)
    p.add_argument("--op", required=True, help="an op, forward_mqa, dcp, or property:NAME (`mla-verify list`)")
    p.add_argument("--path", default=None, help="forward_mqa: bf16 | fp8_mixed | fp8_separate | fp8_mixed_dcp | "
                   "bf16_hisparse | fp8_separate_hisparse; property:NAME: one of its targets (default: all of them, "
                   "drawn)")
    p.add_argument("--world-size", type=int, default=None, choices=(2, 4, 8),
                   help="dcp only: rank processes (default 2); one GPU each when there are enough, else gloo")
    p.add_argument("--impl", action="append", default=[], metavar="[STAGE=]MODULE:CALLABLE|NAME",
                   help="implementation under test: your function as MODULE:CALLABLE (the working directory is "
                        "importable), a registered NAME (`mla-verify list`), or STAGE=... for one stage of "
                        "forward_mqa, dcp or a property; repeat for several stages (default: the project's)")
    _add_deviation(p, [])
    _add_convention(p, [])
    p.add_argument("--examples", type=_positive_int, default=None, metavar="N",
                   help="cases to draw (default: the profile's budget); the op's covering set runs whole first, "
                        "past N where it is larger")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="campaign seed (printed; default: random)")
    p.add_argument("--profile", default=None, metavar="NAME",
                   help="case sizes and budget: ci (small, seconds on CPU) | dev | nightly | gpu (production "
                        "shapes, drawn in blocks of 8 cases of one params: docs/gate.md) "
                        "(default: dev on cpu, gpu on cuda)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="run directory: rows, meta, failing case files; must not hold a run "
                        "(default: a new runs/fuzz-OP-IMPL-TIME)")
    p.add_argument("--no-shrink", action="store_true", help="report the first failing case as found")
    p.add_argument("--no-covering-set", dest="covering", action="store_false", default=None,
                   help="draw N cases without the op's covering set (tests of the harness, benchmarks); the PASS "
                        "line and meta.json say it was skipped (default: it runs whole first, or as --baseline ran)")
    p.add_argument("--junit", type=Path, default=None, metavar="FILE",
                   help="also write a JUnit XML report there for CI: one test case per op and implementation, "
                        "failed with its first failing row (default: none)")
    p.add_argument("--parallel", type=_positive_int, default=None, metavar="N",
                   help="independent campaigns (seeds S, S+1, ...) sharing the examples, one GPU each, dealt "
                        "round-robin when N exceeds the GPUs (a campaign leaves its GPU idle much of the time), "
                        "each with its share of the cores (default: every GPU on cuda, 1 on cpu; dcp: 1, its ranks "
                        "take the GPUs)")
    _add_shard(p, "the campaigns of seeds S + I*P ... of N*P (P: --parallel), the same as one machine's "
                  "--parallel N*P")
    _add_corpus(p)
    p.add_argument("--baseline", type=Path, default=None,
                   help="an earlier run of this op: draw its cases again (its seed, profile, examples and path, unless "
                        "given) and report drift against it")
    _add_drift(p)


def _add_replay_command(sub) -> None:
    """`mla-verify replay` and its options."""
    p = _command(sub, "replay", "re-run a saved failing case exactly; exit 1 if it still fails",
                 "Re-run one case file (saved by fuzz or gate) on the same inputs and say whether the saved "
                 "failure came back: the same failing tensors and metrics with the same values, or what "
                 "moved. The file is data: it is checked against its op's schema, and nothing it names "
                 "is imported unless --impl names it again.",
                 _epilog([("0", "the case passes now"), ("1", "it still fails (the rows say how)"),
                          ("2", "usage error, or a case file that is unreadable or outside its op's schema"),
                          HARNESS, ("4", "NO VERDICT: the implementation declined the case"), ("130", "Ctrl-C")],
                         [("mla-verify replay RUN_DIR/failures/sparse_prefill-mykernels.prefill_fwd-8ea62855f2ee.json "
                           "--impl mykernels.prefill:fwd",
                           "re-run the case fuzz printed, on your kernel as it is now"),
                          ("mla-verify replay CASE.json --impl mykernels.decode:sparse_decode --deviation "
                           "bf16_dequant --device cuda",
                           "the same case on the GPU, with a declared deviation's bounds")]))
    _add_common(p)
    _add_isolation(p)
    _add_reference_memory(p)
    p.add_argument("file", type=Path, help="a case file (failures/*.json of a run directory)")
    p.add_argument("--impl", action="append", default=None, metavar="[STAGE=]MODULE:CALLABLE|NAME",
                   help="the implementation to replay (a case file's MODULE:CALLABLE is never imported unless "
                        "named here; default: the registered implementation saved with the case)")
    _add_deviation(p, None)
    _add_convention(p, None)


def _add_gate_command(sub) -> None:
    """`mla-verify gate` and its options."""
    p = _command(sub, "gate", "CI gate: every op and path, corpus + fuzz + properties; drift report",
                 "Run every op and forward_mqa path with every implementation available on this device: "
                 "the pinned regression corpus first, then a fuzz budget, then every property. Writes one "
                 "run directory (rows, meta, report.html) and exits non-zero on any discrepancy; with "
                 "--baseline also on drift against an earlier run.",
                 _epilog([("0", "no discrepancy and no drift"),
                          ("1", "a discrepancy, crash, hang or broken contract (each failing case saved, its "
                                "replay command printed), or drift beyond the factor against --baseline"),
                          USAGE, HARNESS, NO_VERDICT, INTERRUPTED],
                         [("mla-verify gate --device cpu --out runs/cpu-gate", "the CPU gate, as `make gate` runs it"),
                          ("mla-verify gate --op sparse_decode_fp8 --op property --baseline runs/last-night "
                           "--junit gate.xml", "only decode and the properties, compared with last night's run, "
                           "with a JUnit file for the CI")]))
    _add_common(p)
    _add_isolation(p)
    _add_reference_memory(p)
    p.add_argument("--profile", default=None, help="case sizes and budget (default: ci on cpu, gpu on cuda)")
    p.add_argument("--examples", type=_positive_int, default=None,
                   help="fuzz examples per op (or property) and implementation, or each campaign's whole covering "
                        "set where it is larger; default: the profile's")
    p.add_argument("--seed", type=int, default=None, help="fuzz seed (printed; default: random, or the baseline's)")
    p.add_argument("--op", action="append", default=None,
                   help="restrict to these ops, property:NAME, or property (all of them) (default: everything)")
    p.add_argument("--out", type=Path, default=None, help="run directory (default: a new runs/gate-<time>)")
    p.add_argument("--baseline", type=Path, default=None,
                   help="an earlier gate run: run its cases again (its seed, profile, examples and ops, unless "
                        "given) and report drift against it (default: none)")
    _add_drift(p)
    p.add_argument("--junit", type=Path, default=None, metavar="FILE",
                   help="also write a JUnit XML report there for CI: one test case per op and implementation, "
                        "failed with its first failing row (default: none)")
    p.add_argument("--parallel", type=_positive_int, default=None, metavar="N",
                   help="split the ops over this many processes, one GPU each, dealt round-robin when N exceeds "
                        "the GPUs, each with its share of the cores (default: every GPU on cuda, 1 on cpu)")
    _add_shard(p, "every N-th op and implementation (with its corpus and campaigns), all with seed S")
    p.add_argument("--durations", type=Path, default=None, metavar="FILE",
                   help="size the shards by each op and implementation's seconds last time (longest first, each to "
                        "the shard with the fewest seconds so far): a durations.json a gate or merge wrote, or its "
                        "run directory; none there yet: by count (default: by count)")
    p.add_argument("--impl", action="append", default=None, metavar="OP=MODULE:CALLABLE",
                   help="gate only what these implementations take part in (repeatable): OP=SPEC the op, "
                        "STAGE=SPEC a forward_mqa stage (every forward_mqa path with it swapped in), and every "
                        "property that tests them (default: every registered implementation here)")
    _add_corpus(p)


def _add_merge_command(sub) -> None:
    """`mla-verify merge` and its options."""
    p = _command(sub, "merge", "join the run directories of a run's shards into one run and one report",
                 "Join the run directories that `fuzz --shard I/N` or `gate --shard I/N` wrote (one per "
                 "CI job, array task or pod) into one run directory: every shard's rows, seeds and saved "
                 "failing cases, then the report of `mla-verify report`. Refuses shards of different "
                 "revisions or options, a shard given twice or unfinished, and names the missing shards.",
                 _epilog([("0", "every shard present and no discrepancy"),
                          ("1", "a discrepancy in some shard (its failing cases are copied), or shards missing "
                                "(with --force)"),
                          ("2", "an unreadable run, or shards that do not belong together or are missing "
                                "(each reason named)"),
                          ("3", "a shard ended with a harness error (copied as harness-error-SHARD.txt)")],
                         [("mla-verify merge shards/* --out runs/nightly",
                           "one run of the N shards the CI matrix wrote, with runs/nightly/report.html"),
                          ("mla-verify merge shard-0 shard-2 --out runs/partial --force",
                           "merge what finished although shard 1/3 is missing (exit 1: cases did not run)")]))
    p.add_argument("runs", type=Path, nargs="+", metavar="RUN", help="the shards' run directories")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="the merged run directory (must not hold a run)")
    p.add_argument("--force", action="store_true",
                   help="merge even shards of other revisions or options, given twice or unfinished, or with shards "
                        "missing (each reason is printed)")


def _add_report_command(sub) -> None:
    """`mla-verify report` and its options."""
    p = _command(sub, "report", "drift report of a run directory, optionally against a baseline run",
                 "Summarize a run directory's rows (error distributions per op, path and tensor, headroom, "
                 "failures) in the terminal and in a self-contained HTML file; with --baseline, the two "
                 "runs side by side and a drift verdict. Reads a run that did not finish from its journal, "
                 "and saves the case it died in as a crashed finding under RUN_DIR/failures.",
                 _epilog([("0", "the run finished with no failure and, with --baseline, no drift beyond --factor"),
                          ("1", "the run has failures, did not finish or stopped early, or drift: a normalized "
                                "error, its bias or its headroom grew beyond --factor case for case (or by the "
                                "rank test, unpaired); with --fail-on worse also a group significantly worse within "
                                "the factor (worse is reported, exit 0, by default); or TAMPERED: its rows or failure "
                                "files are not what the run recorded in meta.json"),
                          ("2", "a missing, empty, truncated or malformed run directory (a verdict column that is "
                                "not true/false, a file that is not a regular file), --html/--markdown naming a "
                                "file of a run, a baseline with nothing comparable (no op, or no implementation "
                                "pair, in common), or a bad --pair")],
                         [("mla-verify report runs/cpu-gate", "summary, and runs/cpu-gate/report.html"),
                          ("mla-verify report runs/today --baseline runs/yesterday --markdown summary.md",
                           "drift against yesterday's run, with a markdown summary for the CI page")]))
    p.add_argument("run_dir", type=Path, help="a run directory written by fuzz or gate")
    p.add_argument("--expect", default=None, metavar="DIGEST",
                   help="the record digest the run printed at its end (`record sha256:...`): TAMPERED unless the "
                        "run's record is still that one, for a CI that keeps the digest where the run's processes "
                        "cannot reach it")
    p.add_argument("--baseline", type=Path, default=None, help="an earlier run directory to compare with")
    p.add_argument("--html", type=Path, default=None,
                   help="where to write the HTML report (default: RUN_DIR/report.html)")
    p.add_argument("--markdown", type=Path, default=None, help="also write a markdown summary there")
    _add_drift(p)


def _add_history_command(sub) -> None:
    """`mla-verify history` and its options."""
    p = _command(sub, "history", "drift over many runs of one kernel line: trend, and the steps that got worse",
                 "Read many run directories of one kernel line (commits, versions, nightly runs) in order: per op, "
                 "path, tensor and implementation the trend of the drift metrics (median, p99), the bias with its "
                 "interval and the bound use, and every step between neighbouring runs judged as `report NEW "
                 "--baseline OLD` judges it; the steps that read drifted or worse are printed and marked.",
                 _epilog([("0", "the newest step of every line is not drifted (with --fail-on worse: nor worse)"),
                          ("1", "a line's newest step drifted (or, with --fail-on worse, got worse)"),
                          ("2", "fewer than 2 runs, a directory that is not a run, a revision order that misses a run")],
                         [("mla-verify history runs/nightly-* --html history.html",
                           "the nightly runs in time order, with the page"),
                          ("mla-verify history runs/v1 runs/v2 runs/v3 --order given", "three versions, in that order")]))
    p.add_argument("runs", type=Path, nargs="+", metavar="RUN_DIR", help="run directories written by fuzz or gate")
    p.add_argument("--html", type=Path, default=None,
                   help="write the history page there (and each marked step's worst case beside it)")
    p.add_argument("--order", choices=("time", "given"), default="time",
                   help="run order: when each run finished (default), or as given")
    p.add_argument("--revisions", default=None, metavar="REV,REV,...",
                   help="order the runs by these git revisions (prefixes of their meta.json revision) instead")
    _add_drift(p, pair=False)


def _add_bench_command(sub) -> None:
    """`mla-verify bench` and its options."""
    p = _command(sub, "bench", "kernel, reference and harness speed at production shapes; table + JSON",
                 "Time the kernels (GPU only), the float64 reference and the harness's own cost per case at "
                 "production shapes, print a table and write it as JSON.",
                 _epilog([("0", "measured and written"), ("2", "usage error")],
                         [("mla-verify bench --quick", "a few small shapes: a smoke run"),
                          ("mla-verify bench --only reference --reference-memory 2GiB --out runs/ref.json",
                           "only the reference, with a 2 GiB working-memory budget")]))
    _add_common(p)
    _add_reference_memory(p)
    p.add_argument("--out", type=Path, default=Path("runs/bench.json"), help="the JSON file to write")
    p.add_argument("--quick", action="store_true", help="a few small shapes (a smoke run)")
    p.add_argument("--only", action="append", choices=("kernels", "reference", "harness", "guards", "history"), default=None,
                   help="run only these sections (repeat; default: all)")


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return int(exc.code or 0)
    device = getattr(args, "device", None) or (_default_device() if args.command not in ("report", "merge", "history") else "cpu")
    _prepare(device)
    if getattr(args, "reference_memory", None):
        from mla_verify.reference.streaming import MEMORY_ENV

        os.environ[MEMORY_ENV] = str(args.reference_memory)  # read by the reference here and in every child process
    if getattr(args, "judge", None):
        from mla_verify.equivalence.judge.oracle import use_judge

        use_judge(args.judge)  # read here and in every child process
    from mla_verify.equivalence.errors import HarnessError
    from mla_verify.equivalence.errors import UsageError
    from mla_verify.reports.pairing import PairingError

    try:
        if args.command not in ("list", "report", "merge", "history"):  # it runs cases: on a device that is there
            from mla_verify.api import resolve_device

            device = resolve_device(device)
        return COMMANDS[args.command](args, device)
    except (UsageError, PairingError) as exc:  # PairingError: a --pair naming nothing, or nothing comparable
        print(f"mla-verify: {exc}", file=sys.stderr)
        return 2
    except HarnessError as exc:
        print(f"mla-verify: {exc} (an mla-verify bug: the traceback is in the run directory's harness-error.txt)",
              file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("mla-verify: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`mla-verify list | head`): no traceback, and never a pass
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush writes nowhere
        return 141


def _print_coverage(args) -> int:
    """`list --op OP --coverage` (equivalence.coverage.sets.table)."""
    from mla_verify.equivalence.coverage import sets as coverage
    from mla_verify.equivalence.cases.profiles import PROFILES
    from mla_verify.equivalence.errors import UsageError

    if args.op is None:
        raise UsageError("--coverage needs --op OP")
    print("\n".join(coverage.table(args.op, list(PROFILES.values()), args.draws, path=args.path)))
    return 0


def cmd_list(args, device: str) -> int:
    from mla_verify import describe
    from mla_verify.equivalence import catalog
    from mla_verify.equivalence.errors import UsageError
    from mla_verify.equivalence.subject import did_you_mean
    from mla_verify.optimized import registry

    def wrapped(text: str, first: str = "  ", rest: str = "    ") -> str:
        return "\n".join(textwrap.wrap(text, describe.WIDTH, initial_indent=first, subsequent_indent=rest,
                                        break_on_hyphens=False))

    known = catalog.names()
    if args.op is not None and args.op not in known:
        raise UsageError(f"--op {args.op!r}: unknown; {did_you_mean(args.op, known)}known: {', '.join(known)}")
    if args.coverage:
        return _print_coverage(args)
    print(f"device: {device}")
    if args.op is not None:
        spec = catalog.get_spec(args.op)
        print("\n".join(describe.describe(args.op)))
        if spec.stage is not None:
            print("  implementations (--impl NAME):")
            _print_implementations(registry, spec.stage, device)
    else:
        def show(spec) -> None:
            print(f"\n{spec.name}  [{spec.tag}]\n{wrapped(spec.doc)}")
            for fact in spec.facts(device):
                print(wrapped(fact))
            if spec.stage is not None:
                _print_implementations(registry, spec.stage, device)

        for spec in catalog.specs("op"):
            show(spec)
        for stage in sorted(set(registry.stages()) - {s.stage for s in catalog.specs()}):
            print(f"\n{stage}  [pipeline stage]")
            _print_implementations(registry, stage, device)
        for spec in catalog.specs("property"):
            show(spec)
        print("\nmla-verify list --op OP: one op's call with shapes and dtypes, what it returns, its bounds")
    if args.tolerances:
        print("\n" + "\n".join(describe.tolerance_lines(long=args.long)))
        print("\n" + "\n".join(describe.drift_lines(long=args.long)))
    if args.deviations:
        _print_deviations()
    return 0


def _print_deviations() -> None:
    import textwrap

    from mla_verify.equivalence.judge.policy import DEVIATIONS

    def wrapped(text: str, indent: str = "    ") -> str:
        return textwrap.fill(text, 98, initial_indent=indent, subsequent_indent=indent)

    def bounds(by_kind) -> list[str]:
        return [f"      {kind:4s}" + ", ".join(f"{b.metric} <= {b.limit:.4g}" for b in bs) for kind, bs in by_kind.items()]

    print("\ndeviations (declare with --deviation NAME, deviations=, or __mla_verify_deviations__):")
    for dev in DEVIATIONS.values():
        print(f"\n  {dev.name}\n{wrapped(dev.description)}\n{wrapped('applies to: ' + dev.applies.__doc__)}")
        if dev.bounds:
            print("\n".join(["    bounds against the reference:", *bounds(dev.bounds)]))
        if dev.relaxes:
            print("\n".join([wrapped(f"relaxes the property checks {', '.join(sorted(dev.relaxes))} to:"),
                             *bounds(dev.property_bounds)]))


def _print_implementations(registry, stage: str, device: str) -> None:
    """One line per implementation of `stage`: can it run here, is it the stage's default here
    (what forward_mqa and a bare `--op` use), how it deviates from the contract."""
    try:
        default = registry.select(stage, device).name
    except RuntimeError:
        default = None
    for impl in registry.implementations(stage):
        why = impl.why_not(device)
        status = "available" if why is None else f"unavailable: {why}"
        if impl.name == default:
            status += ", default here"
        elif why is None and device in impl.interpreted_on:
            status += f", interpreted on {device}: by name only"
        dev = f"; deviations: {', '.join(impl.deviations)}" if impl.deviations else ""
        print("\n".join(textwrap.wrap(f"  - {impl.name:12s} {status}{dev}", 100, subsequent_indent=" " * 17)))


# How fuzz's and gate's parsed arguments become `runs.plan.Options` (`_run_options`): a dest named as
# an Options field goes to it, these are translated on the way, these the CLI reads itself; any other
# dest is refused (TypeError), so that an option added or misspelled is never dropped silently.
TRANSLATED = {"op": "ops", "impl": "specs (fuzz) or impls (gate)", "deviation": "deviations",
              "convention": "conventions", "no_shrink": "shrink"}
CLI_ONLY = {"judge": "the judge's kind, set in main", "reference_memory": "the reference's memory, set in main",
            "factor": "drift", "confidence": "drift", "min_cases": "drift", "pair": "drift", "fail_on": "drift"}


def _run_options(args, device: str):
    """fuzz's and gate's `runs.plan.Options` from their parsed `args` on `device` (a fuzz run's
    default directory named for its op and implementation)."""
    from mla_verify.runs.plan import Options
    from mla_verify.runs.rundir import FreshDir

    given, names = vars(args), {f.name for f in fields(Options)}
    stray = sorted(set(given) - names - set(TRANSLATED) - set(CLI_ONLY))
    if stray:
        raise TypeError(f"mla-verify {args.command}: {', '.join(stray)}: neither an Options field, nor in "
                        "TRANSLATED or CLI_ONLY")
    fuzzing = args.command == "fuzz"
    out = args.out
    if fuzzing and out is None:
        out = FreshDir.named("runs", "fuzz", args.op, ",".join(args.impl) or "default")
    return Options(**{**{k: v for k, v in given.items() if k in names}, "device": device, "out": out,
                      "ops": (args.op,) if fuzzing else tuple(args.op or ()),
                      "specs": tuple(args.impl) if fuzzing else (), "impls": () if fuzzing else tuple(args.impl or ()),
                      "deviations": tuple(getattr(args, "deviation", ())),
                      "conventions": tuple(getattr(args, "convention", ())),
                      "shrink": not getattr(args, "no_shrink", False)})


def cmd_fuzz(args, device: str) -> int:
    from mla_verify import api

    options = _run_options(args, device)
    result = api.run(options, log=lambda line: print(line, flush=True))
    print(result.report())
    _print_record(result.out)
    if options.baseline is None or result.interrupted:
        return result.exit_code
    settings = _drift_settings(args)
    drift = api.drift(result, options.baseline, factor=settings.factor, confidence=settings.confidence,
                      min_cases=settings.min_cases, pairs=settings.pairs, fail_on=settings.fail_on)
    replay = (api.save_worst_case(drift.worst, result.out / "drift", options.deviations, options.conventions)
              if drift.worst and result.out else None)
    print("\n".join(drift.lines(replay)))
    nothing = 4 if not drift.compared and args.fail_on is not None else 0  # NO VERDICT under --fail-on
    return result.exit_code or drift.exit_code or nothing


def cmd_replay(args, device: str) -> int:
    from mla_verify import api
    from mla_verify.equivalence.judge.rows import Row

    result = api.replay(args.file, args.impl, device=device, isolate=args.isolate, timeout=args.timeout,
                        deviations=args.deviation, conventions=args.convention, sandbox=args.sandbox, log=print)
    for r in map(Row.from_record, result.rows.to_dict("records")):
        print(f"  ok   {r.tensor:17s} {r.gate_metric} = {r.value:.4g} of {r.bound:.4g}" if r.passed
              else f"  FAIL {r.line()}")
    for note in result.notes:
        print(f"  {note}")
    if result.in_process:
        from mla_verify.reports.meta import IN_PROCESS

        print(f"  {IN_PROCESS}")
    if result.no_verdict:
        print(f"NO VERDICT: {result.no_verdict}")
    return result.exit_code


def cmd_gate(args, device: str) -> int:
    from mla_verify import api, reports
    from mla_verify.reports.meta import IN_PROCESS

    started = time.time()
    options = _run_options(args, device)
    outcome = api.run(options, log=lambda line: print(line, flush=True))
    lines = outcome.lines()
    if lines:
        print("\n".join(lines))
    if outcome.interrupted:
        return 130
    code = reports.run_report(outcome.out, baseline=options.baseline, drift=_drift_settings(args),
                              save_case=api.save_worst_case)
    verdict = ("FAILED" if outcome.failed else "NO VERDICT" if outcome.no_verdict else "passed" if outcome.isolated
               else f"passed ({IN_PROCESS})")
    print(f"gate {verdict}: {len(outcome.rows)} rows in {time.time() - started:.0f} s; "
          f"report {outcome.out / 'report.html'}" + (f"; {outcome.sandbox}" if outcome.sandbox else ""))
    _print_record(outcome.out)
    return 1 if outcome.failed else outcome.exit_code or code


def _print_record(out: Path | None) -> None:
    """The run's record digest, for a CI to keep and hold a later `report` to (--expect)."""
    from mla_verify.runs import record

    if out is not None and (digest := record.digest_of(out)):
        print(f"record sha256:{digest} (mla-verify report {out} --expect {digest})")


def cmd_report(args, device: str) -> int:
    from mla_verify import reports
    from mla_verify.api import load_run, replay_command, save_worst_case
    from mla_verify.runs import record
    from mla_verify.runs.rundir import recover_crashed

    rows, meta = load_run(args.run_dir, "run")
    if meta.get("incomplete"):
        print(f"note: {args.run_dir} stopped early ({meta['stopped']}): its cases not reached have no verdict"
              if meta.get("stopped") else f"note: {args.run_dir} did not finish (killed?): its rows come from its journal")
        for line in recover_crashed(args.run_dir, replay_command):
            print(line)
    if args.baseline is not None:
        load_run(args.baseline, "baseline")
    said, tampered = record.report_lines(args.run_dir, meta, len(rows), args.expect)
    for line in said:
        print(line)
    code = reports.run_report(args.run_dir, baseline=args.baseline, html=args.html, markdown=args.markdown,
                              drift=_drift_settings(args), save_case=save_worst_case)
    return max(code, 1) if tampered else code


def cmd_merge(args, device: str) -> int:
    from mla_verify import reports
    from mla_verify.runs.merge import merge

    merged = merge(args.runs, args.out, force=args.force)
    print("\n".join(merged.lines()))
    code = reports.run_report(merged.out)
    return 3 if merged.harness_errors else max(code, 1 if merged.missing else 0)


def cmd_history(args, device: str) -> int:
    from mla_verify import api

    order = [r for r in args.revisions.split(",") if r] if args.revisions else args.order
    h = api.history(args.runs, html=args.html, order=order, factor=args.factor, confidence=args.confidence,
                    min_cases=args.min_cases, fail_on=args.fail_on or "drifted")
    print("\n".join(h.lines()))
    if args.html is not None:
        print(f"html history: {args.html}")
    return h.exit_code


def cmd_bench(args, device: str) -> int:
    from .bench import bench

    return bench.main(args, device)


COMMANDS = {"list": cmd_list, "fuzz": cmd_fuzz, "replay": cmd_replay, "gate": cmd_gate, "merge": cmd_merge,
            "report": cmd_report, "history": cmd_history, "bench": cmd_bench}

if __name__ == "__main__":
    sys.exit(main())
