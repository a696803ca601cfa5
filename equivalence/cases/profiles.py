"""Fuzz profiles: how many examples per op and how large the drawn cases may get.

    ci       CPU, bounded: small shapes the Triton interpreter runs in seconds (the CI gate)
    dev      CPU or GPU, a broader sweep for a developer's loop
    nightly  long runs: larger shapes, more examples
    gpu      H200: production shapes (topk up to 2048, up to 128 heads, long contexts)

A campaign of Triton kernels on CPU runs them under the interpreter, thousands of times slower
than compiled: its cases are drawn within `interpreter_s` seconds each (the estimate of
`equivalence.cases.cost`, `interpreted()`), so a CPU run has a bounded cost. ci's 10 s admits the
largest problem its properties must pose, HiSparse against the plain path at FP8 (one prefill past
the plain path's 128-token decode threshold at 32 heads, both paths: 8-9 s), with room for a few
decodes; every other ci draw estimates under 4 s. Compiled kernels (a GPU) and the eager ones are
never held to it.

gpu draws in blocks of 8 cases (`block`): one Hypothesis draw, then its params at 8 seeds, whose
reference runs as one batch and whose checks are judged at once (`fuzz.campaign`). On the H200 a
drawn case costs milliseconds of Hypothesis and each reference and judging call as many of
launches; the CPU profiles run one case a draw (their Triton is interpreted: the kernel is the cost).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Profile:
    name: str
    examples: int                 # fuzz examples per op in the gate
    max_tokens: int               # query tokens of a single-op case
    heads: tuple[int, ...]        # head counts drawn
    prefill_topk: tuple[int, ...]  # multiples of 128 (prefill kernel granularity)
    decode_topk: tuple[int, ...]   # multiples of 64 (decode kernel granularity), some odd (routing: decode_topk)
    max_context: int              # longest context a request may have
    max_requests: int
    max_query: int                # longest prefill query
    block_sizes: tuple[int, ...]
    mqa_heads: tuple[int, ...]    # forward_mqa heads: < 32 takes the mixed FP8 path, >= 32 the separate one
    property_examples: int        # fuzz examples per property in the gate (a case runs the implementation 2-6 times)
    interpreter_s: float | None   # interpreted Triton: the seconds a case may take (None: unbounded)
    budget_s: float | None = None  # the bound this campaign's draws hold to (`interpreted`); None: none
    block: int = 1                # cases per drawn example (its params at successive seeds: `fuzz.campaign`)
    strength: int = 2             # the covering arrays' (`coverage.pairs`): pairs, triples where the budget holds them
    pair_s: float | None = None   # interpreter seconds (`cost`) a covering array's case may take (None: unbounded)

    def interpreted(self) -> "Profile":
        """This profile for a campaign of interpreted kernels: draws within `interpreter_s` a case."""
        return replace(self, budget_s=self.interpreter_s)


PROFILES = {
    p.name: p
    for p in (
        Profile("ci", 6, 4, (1, 8, 16), (128, 256), (64, 128, 192), 320, 3, 6, (64, 128), (8, 16, 32), 3, 10.0,
                pair_s=0.8),
        Profile("dev", 40, 16, (8, 16, 32, 64), (128, 256, 512), (64, 128, 256, 512), 1200, 5, 24, (64, 128, 256),
                (8, 16, 32, 64), 20, 60.0, pair_s=6.0),
        Profile("nightly", 300, 64, (8, 16, 32, 64, 128), (128, 512, 1024, 2048), (64, 256, 1024, 2048), 9000, 8, 128,
                (64, 128, 256), (8, 16, 24, 32, 64, 128), 150, 600.0, strength=3, pair_s=60.0),
        Profile("gpu", 200, 256, (16, 32, 64, 128), (512, 1024, 2048), (512, 576, 1024, 2048), 20000, 8, 512, (64, 128),
                (8, 16, 32, 64, 128), 50, None, block=8, strength=3),
    )
}

# What serving produces, in every profile's covering sets (`coverage`), whatever its random draws
# reach: DeepSeek V3.2's 128 heads at TP1 (64 at TP2), each with a finite sink where the op takes
# one; its top-k of 2048; and top-k widths off the power-of-two instantiation tables that vLLM,
# FlashInfer and SGLang dispatch bugs sat at (192, 256: FlashInfer #4372, SGLang #33134; 1152).
PRODUCTION_HEADS = (64, 128)
PRODUCTION_TOPK = 2048
OFF_TABLE_TOPK = (192, 256, 1152)


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}")
    return PROFILES[name]
