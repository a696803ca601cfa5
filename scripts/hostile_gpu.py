"""The hostile campaign on a GPU (issue 13's must-show; `scripts/gpu_lane.sh hostile`).

1. `mla-verify fuzz` against tests.hostile.cuda:assert_on_three_tokens, a prefill kernel that hits
   a device-side assert on every case of 3 tokens or more, once per `--timeouts` entry (10 s and
   the default). It must end with exit 1 and a saved case minimized to tokens = 3; `mla-verify
   replay` of that file must exit 1 and reproduce the crash; no row may be "hung" (the correct
   cases between the crashes run in fresh workers), every failing row has >= 3 tokens and every
   passing row fewer.
2. With `--others`: one short campaign (no shrinking) per other CUDA hostile kernel: an illegal
   address from a Triton kernel, a spinning kernel, os.abort, a kernel corrupting kv_cache in
   place, a result on the host. Each must end with exit 1 and its expected failing row.

A short table is printed last; the exit code is 0 when every expectation holds.
    python3 scripts/hostile_gpu.py --out runs/hostile [--timeouts 10,default] [--others] [--seed 1]
CI runs the same script on CPU against a kernel that aborts on 3 rows or more
(`--device cpu --op quantize_fp8_ds_mla --impl tests.hostile.cpu:aborts_on_three_rows --param n`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ASSERT = "tests.hostile.cuda:assert_on_three_tokens"


def cli(*argv: str, log: Path) -> tuple[int, str, float]:
    start = time.monotonic()
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-m", "mla_verify.cli", *argv], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        f.write(done.stdout)
    return done.returncode, done.stdout, time.monotonic() - start


def load_rows(run: Path):
    """The run's rows (its journal if it was killed), or none if it left nothing."""
    from mla_verify import reports

    try:
        return reports.load_run(run)[0]
    except (OSError, ValueError):
        return reports.rows_frame([])


def saved_case(text: str) -> str | None:
    lines = [line.split("case saved: ", 1)[1] for line in text.splitlines() if "case saved: " in line]
    return lines[-1] if lines else None


def assert_campaign(args, timeout: str) -> dict:
    from mla_verify.fuzz import casefile

    out, name = args.out, f"crash-t{timeout}"
    flags = ([] if timeout == "default" else ["--timeout", timeout]) + ["--device", args.device, "--isolate"]
    flags += ["--profile", args.profile] if args.profile else []
    code, text, secs = cli("fuzz", "--op", args.op, "--impl", args.impl, "--seed", str(args.seed), "--examples",
                           str(args.examples), "--out", str(out / name), *flags, log=out / f"{name}.log")
    row = {"what": f"{args.impl.split(':')[1]}, timeout {timeout}", "exit": code, "secs": secs}
    path = saved_case(text)
    tokens = casefile.load(Path(path)).case.params[args.param] if path else None
    rows = load_rows(out / name)
    passing, failing = rows[rows.passed], rows[~rows.passed]
    row.update(tokens=tokens, hung=int((rows.gate_metric == "hung").sum()), passed=len(passing), failed=len(failing),
               split=bool(len(failing)) and (passing.num_tokens < 3).all() and (failing.num_tokens >= 3).all())
    if path:
        rcode, rtext, rsecs = cli("replay", path, "--impl", args.impl, *flags[: flags.index("--isolate") + 1],
                                  log=out / f"{name}-replay.log")
        row.update(replay=rcode, reproduced="reproduced" in rtext and "did NOT" not in rtext, secs=secs + rsecs)
    row["ok"] = (code == 1 and tokens == 3 and row["hung"] == 0 and row["split"] and row.get("replay") == 1
                 and row.get("reproduced", False))
    return row


def other_campaign(out: Path, impl: str, op: str, metric: str, says: str, seed: int) -> dict:
    name = impl.split(":")[1]
    code, text, secs = cli("fuzz", "--op", op, "--impl", impl, "--device", "cuda", "--seed", str(seed),
                           "--examples", "8", "--timeout", "10", "--no-shrink", "--out", str(out / name),
                           log=out / f"{name}.log")
    rows = load_rows(out / name)
    failing = rows[~rows.passed]
    found = bool(((failing.gate_metric == metric) & failing.reason.str.contains(says, regex=False)).any())
    hung = int((rows.gate_metric == "hung").sum())
    return {"what": name, "exit": code, "secs": secs, "tokens": None, "hung": hung, "passed": int(rows.passed.sum()),
            "failed": len(failing), "replay": None, "reproduced": None,
            "ok": code == 1 and found and saved_case(text) is not None and (hung == 0 or metric == "hung")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/hostile"))
    parser.add_argument("--timeouts", default="10,default", help="comma-separated: seconds, or 'default'")
    parser.add_argument("--others", action="store_true", help="also the other CUDA hostile kernels")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--examples", type=int, default=30)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--op", default="sparse_prefill")
    parser.add_argument("--impl", default=ASSERT, help="crashes on cases whose --param is 3 or more")
    parser.add_argument("--param", default="tokens", help="the case parameter the crash depends on")
    parser.add_argument("--profile", default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    from tests.hostile import CUDA

    table = [assert_campaign(args, t) for t in args.timeouts.split(",") if t]
    if args.others:
        table += [other_campaign(args.out, h.impl, h.op, h.metric, h.says, args.seed) for h in CUDA if h.impl != ASSERT]
    print(f"{'campaign':44s} {'exit':>4s} {'tokens':>6s} {'replay':>6s} {'reprod':>6s} {'pass':>5s} {'fail':>5s} "
          f"{'hung':>5s} {'secs':>6s}  verdict")
    for r in table:
        fmt = lambda v: "-" if v is None else str(v)  # noqa: E731
        print(f"{r['what']:44s} {r['exit']:>4d} {fmt(r['tokens']):>6s} {fmt(r.get('replay')):>6s} "
              f"{fmt(r.get('reproduced')):>6s} {r['passed']:>5d} {r['failed']:>5d} {r['hung']:>5d} {r['secs']:>6.0f}  "
              f"{'ok' if r['ok'] else 'NOT MET'}")
    return 0 if all(r["ok"] for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
