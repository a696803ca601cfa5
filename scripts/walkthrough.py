"""Rewrite the output blocks of README.md's walkthrough ("Verify your kernel in 5 minutes") from a
real run of its commands.

Each block sits between `<!-- walkthrough:NAME -->` and `<!-- /walkthrough:NAME -->` and holds
what its commands print, run as a user runs them: in a fresh directory outside this checkout with
examples/*.py copied in (paths under it printed relative to it), on CPU. What differs run to run
(a run directory's timestamp, its record's digest, the sandbox layers the host allows, pytest's duration and with it its summary line's width, its
platform, rootdir and plugins lines, the progress lines of a slow run) is masked when checking; tests/test_examples.py fails when
the README drifts from what the commands print (the walkthrough stays in README.md; the rest of
the documentation is the site under docs/).

    .venv/bin/python scripts/walkthrough.py           # from the repository root: rewrite README.md
    .venv/bin/python scripts/walkthrough.py --check   # exit 1 (and the first difference) if out of date
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
COMMAND = ".venv/bin/python scripts/walkthrough.py"
RUN_DIR = re.compile(r"runs/fuzz-[\w.-]+?-\d{8}-\d{6}")
VARYING = [(re.compile(r"\d{8}-\d{6}"), "TIME"), (re.compile(r"[0-9a-f]{64}"), "DIGEST"),
           # the sandbox's layers are the host's (a CI runner may refuse user namespaces)
           (re.compile(r"sandbox (auto|strict|off)[^\n]*"), "sandbox ..."),
           (re.compile(r"^=+ (.*) in [\d.]+s( \(.*\))? =+$", re.M), r"= \1 in Ns ="),
           (re.compile(r"^(platform|rootdir:|plugins:) .*$", re.M), r"\1 ..."),
           # a slow or loaded machine prints progress lines a fast one does not
           (re.compile(r"^  \[[\w:]+\] \d+/\d+ cases, .* elapsed.*\n", re.M), "")]


def _start(cwd: Path, command: str):
    """Start a shown command line as the user runs it; the returned function waits for it and gives
    (exit code, "$ COMMAND" as the README shows it, what it printed). Commands that do not wait on
    each other's output run side by side (the walkthrough's check is a CI test: its second core)."""
    argv = shlex.split(command)
    prefix = [sys.executable, "-m", "mla_verify.cli"] if argv[0] == "mla-verify" else [sys.executable, "-m", "pytest",
                                                                                      "-p", "no:cacheprovider"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", COLUMNS="80")
    output = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(prefix + argv[1:], cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)

    def finished() -> tuple[int, str, str]:
        code = proc.wait(timeout=600)
        output.seek(0)
        out = output.read()
        output.close()
        # Paths as the user's shell sees them: relative to the directory, which the README calls ~/mykernels.
        out = out.replace(f"{cwd.resolve()}/", "").replace(f"{cwd}/", "").replace(str(cwd.resolve()), "~/mykernels")
        return code, f"$ {RUN_DIR.sub('runs/fuzz-...', command)}\n", out

    return finished


def runs() -> dict[str, list[tuple[int, str, str]]]:
    """Each block's commands, run as the walkthrough runs them in a fresh directory: (exit code,
    "$ COMMAND", what it printed) each (tests/test_examples.py reads the exit codes too)."""
    with tempfile.TemporaryDirectory(prefix="mla-verify-walkthrough-") as tmp:
        cwd = Path(tmp) / "mykernels"
        cwd.mkdir()
        for name in ("my_kernel.py", "test_my_kernel.py"):
            shutil.copy(ROOT / "examples" / name, cwd / name)
        listed, draft, fixed, pytest = (_start(cwd, command) for command in (
            "mla-verify list --op sparse_prefill",
            "mla-verify fuzz --op sparse_prefill --impl my_kernel:sparse_prefill_v0 --profile ci --seed 1",
            "mla-verify fuzz --op sparse_prefill --impl my_kernel:sparse_prefill --profile ci --seed 1",
            "pytest --mla-verify-profile ci"))
        found = {"list": [listed()], "fuzz": [draft()]}
        out = found["fuzz"][0][2]
        replay = next(line.split("replay: ", 1)[1] for line in out.splitlines() if line.startswith("  replay: "))
        replays = [_start(cwd, command)
                   for command in (replay, replay.replace("my_kernel:sparse_prefill_v0", "my_kernel:sparse_prefill"))]
        found["replay"] = [r() for r in replays] + [fixed()]
        found["pytest"] = [pytest()]
    return found


def blocks(ran: dict[str, list[tuple[int, str, str]]] | None = None) -> dict[str, str]:
    """Each block's text, from `ran` (default: running the walkthrough now, `runs`)."""
    ran = runs() if ran is None else ran
    code, shown, out = ran["fuzz"][0]
    found = {"list": ran["list"][0][2].split("  implementations (--impl NAME):")[0] + "...\n",
             "fuzz": shown + out + f"$ echo $?\n{code}\n",
             "replay": "".join(shown + out for _, shown, out in ran["replay"]),
             "pytest": "".join(shown + out for _, shown, out in ran["pytest"])}
    return {name: f"```\n{text}```\n" for name, text in found.items()}


def stale(text: str, found: dict[str, str]) -> str | None:
    """Where README.md's `text` differs from the `found` blocks (masked), as the first differing
    line of the first such block; None where every block holds what its commands print."""
    for name, block in found.items():
        start, stop = region(text, name)
        if masked(text[start:stop]) != masked(block):
            old_lines, new_lines = masked(text[start:stop]).splitlines(), masked(block).splitlines()
            first = next((i for i, (a, b) in enumerate(zip(old_lines, new_lines)) if a != b),
                         min(len(old_lines), len(new_lines)))
            return (f"README.md's walkthrough block {name!r} is out of date at its line {first + 1}: run {COMMAND}\n"
                    f"  README:  {old_lines[first] if first < len(old_lines) else '(ends)'}\n"
                    f"  printed: {new_lines[first] if first < len(new_lines) else '(ends)'}")
    return None


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- walkthrough:{name} -->\n", f"<!-- /walkthrough:{name} -->\n"


def region(text: str, name: str) -> tuple[int, int]:
    """Where block `name`'s text lies in `text` (between its markers, each on a line of its own)."""
    begin, end = _markers(name)
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"README.md: no {begin.strip()} ... {end.strip()} region")
    return start + len(begin), stop


def masked(text: str) -> str:
    for pattern, replacement in VARYING:
        text = pattern.sub(replacement, text)
    return text


def main(argv: list[str]) -> int:
    text = README.read_text()
    found = blocks()
    if "--check" in argv:
        problem = stale(text, found)
        if problem:
            print(problem, file=sys.stderr)
            return 1
        return 0
    new = text
    for name, block in found.items():
        start, stop = region(new, name)
        new = new[:start] + block + new[stop:]
    if new != text:
        README.write_text(new)
        print("README.md: walkthrough blocks rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
