"""What `gate --impl OP=MODULE:CALLABLE` runs: the gate restricted to what the named
implementations take part in.

`OP=SPEC` names an implementation of an op (`sparse_prefill=mykernels:prefill`), `STAGE=SPEC` one
of a stage inside `forward_mqa` (most ops are stages too: `sparse_decode_fp8=...` is both), and
`forward_mqa=SPEC` / `dcp=SPEC` a whole pipeline or rank body. The units (`runs.units.Unit`):

* each named op with its implementation (its pinned corpus and campaigns, as the gate runs it);
* `forward_mqa` with every named stage swapped in, on every path that calls one of them
  (`PipelineSpec.paths_calling`), each a campaign of its own (its covering set and pairs);
* every property one of whose targets tests a named stage, with the stages swapped in, on the
  targets they cover (a property that does not run on the device is left out, as the gate does).
"""

from __future__ import annotations

from typing import Sequence

from mla_verify.equivalence import catalog
from mla_verify.equivalence.errors import UsageError
from mla_verify.equivalence.subject import described
from mla_verify.equivalence.sandbox.device import device_type
from .units import Unit
from mla_verify.optimized import registry

PIPELINE = "forward_mqa"


def parse(impls: Sequence[str]) -> dict[str, str]:
    """{op or stage: implementation} of `--impl KEY=SPEC` strings; UsageError naming a bad one."""
    ops, stages, chosen = catalog.names("op"), registry.stages(), {}
    for text in impls:
        key, eq, spec = text.partition("=")
        if not eq or not spec or not key:
            raise UsageError(f"gate --impl {text!r}: expected OP=MODULE:CALLABLE or STAGE=MODULE:CALLABLE "
                             f"(or =NAME of a registered implementation)")
        if key not in ops and key not in stages:
            raise UsageError(f"gate --impl {text!r}: {key!r} is neither an op nor a forward_mqa stage; ops: "
                             f"{', '.join(ops)}; stages: {', '.join(stages)}")
        if key in chosen:
            raise UsageError(f"gate --impl {key}= is given twice: name each op or stage once")
        chosen[key] = spec
    return chosen


def impl_units(impls: Sequence[str], device: str, ops: Sequence[str] | None = None) -> list[Unit]:
    """The gate's units for the implementations `impls` (`--impl KEY=SPEC` strings) on `device`,
    in catalog order; `ops` (as `gate --op`) keeps only those. Every unit's implementation is
    resolved here from the --impl strings and a user's module's source, never importing it (its
    isolation worker does, before any case runs: `runs.start.judging`), so a bad name is a usage
    error here."""
    chosen = parse(impls)
    kind = device_type(device)
    stage_specs = tuple(f"{k}={v}" for k, v in chosen.items() if k in registry.stages())
    wanted = set(catalog.select(ops)) if ops else None
    found = []
    with described():
        for spec in catalog.specs():
            if wanted is not None and spec.name not in wanted:
                continue
            if spec.name in chosen:
                found.append(Unit(spec.name, chosen[spec.name], (chosen[spec.name],)))
            elif spec.name == PIPELINE and (paths := spec.paths_calling(chosen)):
                found.append(Unit(PIPELINE, catalog.resolve_subject(PIPELINE, stage_specs, kind, described=True).label,
                                  stage_specs, paths=paths))
            elif spec.family == "property" and stage_specs and spec.subjects(kind):
                try:
                    spec.subject(stage_specs, kind)
                except UsageError:  # it tests none of the named stages
                    continue
                found.append(Unit(spec.name, ",".join(stage_specs), stage_specs))
    if not found:
        among = f" among --op {' '.join(ops)}" if ops else ""
        raise UsageError(f"gate --impl {' '.join(impls)}: nothing to run{among}")
    for unit in found:
        unit.resolved(kind, described=True)  # UsageError now for a module that is not on the path
    return found
