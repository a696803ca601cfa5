"""The judge a unit's campaigns call on each block of cases (`fuzz.campaign.Judge`): the run's
`Judging` in the unit's row context, a lost CUDA context told to the run, a judge that ran out of
device memory given a second and third try, and a decline asked again (`runs.declines`)."""

from __future__ import annotations

import gc
import time
from dataclasses import replace

import torch

from mla_verify.equivalence import catalog
from mla_verify.equivalence.blocks import Judging
from mla_verify.equivalence.cases.values import release_pools
from mla_verify.equivalence.judge.rows import FailureKind, Row, RowContext
from mla_verify.equivalence.sandbox import device as dev
from mla_verify.equivalence.subject import Subject
from mla_verify.fuzz.campaign import Judge, Stop

from .declines import asked_again
from .sink import Sink

OOM_WAITS = (2.0, 8.0)  # seconds a block the judge ran out of device memory for waits before each retry


def unit_judge(subject: Subject, judging: Judging, context: RowContext, losing: Sink | None) -> Judge:
    """What a unit's cases are judged by: `judging`'s blocks of `subject` in `context`, within the
    card's memory, declines asked again. With `losing` (a fuzz run), a CUDA context the
    implementation took with it ends the campaign (`Sink.lose`)."""
    return asked_again(_within_memory(_block_runner(subject, judging, context, losing), context))


def _block_runner(subject: Subject, judging: Judging, context: RowContext, losing: Sink | None) -> Judge:
    """(cases, source, on_call) -> each case's rows (None: not judged), for a campaign's blocks
    (`fuzz.campaign`), by the run's `judging`, in `context` at the block's source."""
    def judged(cases, source, on_call):
        found = judging.block(cases, subject, replace(context, source=source, on_call=on_call))
        if losing is not None and judging.lost:
            losing.lose(Stop.DEVICE_LOST)
        return found

    return judged


def _within_memory(judge: Judge, context: RowContext) -> Judge:
    """`judge`, where the judge's own side (inputs, reference, verdicts; never the implementation's
    call, whose failure is its own) runs out of device memory because the other parts on the card
    peaked with it: its cached memory given back, the block waits and runs again, then one case at
    a time; a case that still does not fit is a `not_judged` row of this part's log, counted and
    not failed, and the run goes on (it was exit 3 for the whole run)."""
    def judged(cases, source, on_call):
        told = []  # the campaign hears of each case's call once, whatever is retried

        def once() -> None:
            if len(told) < len(cases):
                told.append(True)
                on_call()

        for wait in OOM_WAITS:
            try:
                return judge(cases, source, once)
            except torch.OutOfMemoryError as exc:
                error = exc
            _give_back(wait)
        if len(cases) > 1:
            return [rows for case in cases for rows in judged([case], source, once)]
        base = catalog.row_base(cases[0], replace(context, source=source))
        return [[Row(**base, tensor="*", passed=True, gate_metric=FailureKind.NOT_JUDGED, value=0.0, bound=0.0,
                     headroom=float("inf"), reason=f"not judged: the judge ran out of device memory "
                     f"({dev.first_line(error)}); fewer --parallel parts or a smaller --reference-memory fit it")]]

    return judged


def _give_back(seconds: float) -> None:
    """This process's input pools and cached device memory back to the card, then a wait for the
    other parts'."""
    release_pools()
    gc.collect()
    torch.cuda.empty_cache()
    time.sleep(seconds)
