"""The covering features of the properties whose inputs the random draws reach too rarely
(`coverage.sets`): batch_invariance's batches of other compositions.

A request's output alone and inside a batch is equal only while the kernel plans the same work for
it: a split-KV plan read from the launch's row count (tokenspeed #904) changes where the rows pass
the number of programs the machine holds, which the random draws (a batch of 8 at ci's top-k of
192 at most) never reach. So the property's first cases are batches of 16 single-token requests and
of 8 spec decodes (B * s_q rows: speculative decoding's target verify) at production's top-k.
"""

from __future__ import annotations

import random

from ..cases.profiles import PRODUCTION_TOPK, Profile
from .registry import Coverage, register

BATCHED = ("a batch of 16 or more rows at top-k 2048", "spec decodes (s_q > 1) in a batch of 8 or more",
           "a request alone past the first")


def _batched_candidates(rng: random.Random, p: Profile) -> list[dict]:
    found = []
    for _ in range(2):
        for batch, s_q in ((16, 1), (8, rng.randint(2, 4))):
            found.append({"target": "sparse_decode_fp8", "batch": batch, "s_q": s_q, "heads": min(p.heads),
                          "topk": PRODUCTION_TOPK, "seq_lens": [rng.randint(1024, 2100) for _ in range(batch)],
                          "page_size": 64, "sm_scale": 0.1352, "value_regime": rng.choice(("normal", "flat")),
                          "scale_rule": "pow2", "invalid": rng.choice(([], ["scattered"])),
                          "alone": sorted(rng.sample(range(1, batch), 2))})
    return found


def _batched_hits(p, kw: dict) -> set[str]:
    if "alone" not in kw:  # the forward_mqa target's cases
        return set()
    q = kw["batch"]["q"]
    batch, s_q, k = q.shape[0], q.shape[1], kw["batch"]["indices"].shape[-1]
    return {name for name, yes in zip(BATCHED, (batch * s_q >= 16 and k == PRODUCTION_TOPK,
                                                s_q > 1 and batch >= 8, any(i > 0 for i in p.alone))) if yes}


for _target in ("sparse_decode_fp8", None):
    register("property:batch_invariance", _target, Coverage(BATCHED, _batched_candidates, _batched_hits))
