"""`mla-verify bench` on CPU with the harness and guards sections' decode case at another shape:
`python scripts/bench_cpu_case.py B,H,TOPK,SEQ bench --only guards ...`. The CPU's own harness
case (B=2 H=16) has 0.1 MiB of outputs; a large-output case (B=64 H=128: 16 MiB, the H200's)
shows what the message path costs. It patches `bench.harness_case` only, so it runs against any
checkout whose bench has one (PYTHONPATH=<a tree's packages>): before and after a change alike."""

import sys

from mla_verify.bench import bench
from mla_verify.cli import main
from mla_verify.equivalence.cases.case import Case


def harness_case(batch: int, heads: int, topk: int, seq: int):
    default = bench.harness_case

    def case(device: str) -> Case:
        c = default(device)
        params = {**c.params, "batch": batch, "heads": heads, "topk": topk, "seq_lens": [seq] * batch}
        return Case(c.op, params, c.seed)

    return case


if __name__ == "__main__":
    bench.harness_case = harness_case(*map(int, sys.argv[1].split(",")))
    sys.exit(main(sys.argv[2:]))
