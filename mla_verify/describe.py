"""What `mla-verify list --op OP` and `list --tolerances` print, generated from the harness's own
data rather than written out by hand: the keywords, their declared shapes and the formula come
from the op's contract (`equivalence.contracts`), the shapes and dtypes from what an implementation really receives on
the op's smallest pinned corpus case (fuzz/corpus), the compared tensors from the reference's
answer to that case, and the bounds from the tolerance policy."""

from __future__ import annotations

import textwrap
from typing import Any

WIDTH = 100


class _Called(Exception):
    """Raised by the recording stand-in once it has seen its keyword arguments."""


def _wrap(text: str, first: str, rest: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)


def _packed(parts: list[str], first: str, rest: str) -> list[str]:
    """`parts` on lines of at most WIDTH, broken only between parts (a part wider is wrapped alone)."""
    lines = [first]
    for part in parts:
        if lines[-1] not in (first, rest) and len(lines[-1]) + 1 + len(part) > WIDTH:
            lines.append(rest)
        if len(lines[-1]) + len(part) > WIDTH:
            lines[-1:] = _wrap(part, lines[-1], rest)
        else:
            lines[-1] += ("" if lines[-1] in (first, rest) else " ") + part
    return lines


def keywords(op: str) -> tuple[str, ...]:
    """The keyword arguments every implementation of `op` must accept."""
    from mla_verify.equivalence.catalog import get_spec

    return get_spec(op).arguments


def _pinned_cases(op: str) -> list:
    """The op's corpus cases, smallest first."""
    from mla_verify.equivalence.catalog import get_spec
    from mla_verify.fuzz.regressions import corpus

    return sorted((case for case, _ in corpus(op)), key=lambda c: get_spec(op).params_of(c.params).elements())


def _shown_case(spec, cases: list):
    """The case `list --op` shows, whole: of the pinned cases passing the most optional tensors
    (one case for every shape, so the header's sizes are the tensors'), the smallest."""
    if spec.own_processes or not cases:
        return cases[0] if cases else None
    given = [sum(v is not None for v in (_received(spec, c) or {}).values()) for c in cases]
    return cases[given.index(max(given))]


# A configuration of each forward_mqa path, for the stages it calls (`optimized.pipeline.needed_stages`).
PATH_CONFIGS = {"bf16": ("bfloat16", 16, 1), "fp8_mixed": ("fp8_ds_mla", 16, 1),
                "fp8_separate": ("fp8_ds_mla", 32, 1), "fp8_mixed_dcp": ("fp8_ds_mla", 16, 2)}


def _stages_by_path() -> dict[str, list[str]]:
    from mla_verify.optimized.pipeline import needed_stages

    return {path: needed_stages(*config) for path, config in PATH_CONFIGS.items()}


def _declared_dims(ops: list[str]) -> dict[str, list[tuple[str, ...]]]:
    """Each keyword's dimension names as the contracts of `ops` declare them ("q[T,H,576] bf16" ->
    ("T", "H", "576")), every declaration of the name in order."""
    import re

    from mla_verify.equivalence.contracts import CONTRACTS, declared

    found: dict[str, list[tuple[str, ...]]] = {}
    for op in ops:
        for text in declared(op) if op in CONTRACTS else ():
            if m := re.match(r"(\w+)\[([\w,]+)\]", text):
                found.setdefault(m.group(1), []).append(tuple(m.group(2).split(",")))
    return found


def _form(value: Any, names: list[tuple[str, ...]]) -> str:
    """A value as the call receives it, a tensor's dimensions labelled with the first of `names`
    (its contract's) of its rank: `bfloat16[T=6, H=64, 576]`."""
    import torch

    if isinstance(value, torch.Tensor):
        dims = next((n for n in names if len(n) == value.dim()), ())
        shape = ", ".join(f"{n}={d}" if n and not n.isdigit() else str(d)
                          for n, d in zip(dims or ("",) * value.dim(), value.shape))
        return f"{str(value.dtype).removeprefix('torch.')}[{shape}]"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_form(v, names) for v in value) + ")"
    if value is None:
        return "None"
    return f"{type(value).__name__} {value!r}"


def _stage_lines(op: str) -> list[str]:
    """A pipeline's stages by path, each with its contract (the call and what it returns)."""
    from mla_verify.equivalence.contracts import CONTRACTS, declared, returns

    by_path = _stages_by_path()
    lines = ["  stages, in the order a call runs them (each judged on its own inputs when a case fails):"]
    for path, stages in by_path.items():
        lines += _packed([f"{s} ->" for s in stages[:-1]] + stages[-1:], f"    {path}: ", "        ")
    for stage in dict.fromkeys(s for stages in by_path.values() for s in stages):
        contract = stage if stage in CONTRACTS else "sparse_decode_fp8"  # the nvfp4 decode takes fp8's form
        lines += _packed([f"{text}," for text in declared(contract)], f"    {stage}(", "      ")
        lines[-1] = lines[-1].removesuffix(",") + ")"
        lines += _wrap(f"-> {returns(contract)}", "      ", "        ")
    return lines


def _received(spec, case) -> dict[str, Any] | None:
    """The keyword arguments an implementation receives for `case`, as the harness calls it
    (None for an op whose implementation runs in rank processes of its own)."""
    from mla_verify.equivalence.subject import Subject

    if spec.own_processes:
        return None
    seen: dict[str, Any] = {}

    def record(**kwargs: Any):
        seen.update(kwargs)
        raise _Called

    params = spec.params_of(case.params)
    try:
        spec.call(Subject(label="list", fn=record), spec.inputs(params, case.seed, "cpu"), params)
    except _Called:
        pass
    return seen


def _bounds_text(kind: str, case: Any, rows: int, derived: bool = False) -> str:
    """The bounds of a tensor of `kind` with `rows` rows (vectors along its last dim); `derived`:
    its reference derives per-element bounds. A bound that scales with the case says how, and
    what it comes to on this one."""
    from mla_verify.equivalence.judge.policy import bounds_for, limit_for

    bounds, _ = bounds_for(kind, case)
    parts = []
    for b in bounds:
        if b.metric == "elem_bound_ratio" and not derived:
            continue
        scaled = limit_for(b, rows) if b.metric == "abs_mean_err" else b.limit
        parts.append(f"{b.metric} <= {b.limit:.4g}" if scaled == b.limit else
                     f"{b.metric} <= max({b.limit:.4g}, 5 * 2^-9 / sqrt(rows)) = {scaled:.4g} at its {rows} rows")
    return ", ".join(parts)


def describe_op(op: str) -> list[str]:
    """`op`'s contract: the call with keyword names, shapes and dtypes, what is returned and
    compared, and each compared tensor's bounds."""
    from mla_verify.equivalence.catalog import get_spec

    spec = get_spec(op)
    cases = _pinned_cases(op)
    case = _shown_case(spec, cases)
    from mla_verify.equivalence.contracts import declared, formula, returns
    from mla_verify.equivalence.judge.localize import dims_of
    from mla_verify.equivalence.judge.policy import EXACT

    lines = [*_wrap(f"{op}: {spec.doc}", "", "  ")]
    lines += _packed([f"{text}," for text in declared(op)], "  | impl(", "  |      ")
    lines[-1] = lines[-1].removesuffix(",") + ")"
    lines += _wrap(f"-> {returns(op)}", "  |   ", "  |      ")
    for paragraph in formula(op).split("\n\n"):
        lines += _wrap(" ".join(paragraph.split()), "  | ", "  | ")
    if case is None:
        return lines + _wrap(f"call: impl({', '.join(spec.arguments)})", "  ", "      ")
    declared_dims = _declared_dims([op] + ([s for st in _stages_by_path().values() for s in st]
                                          if op == "forward_mqa" else []))
    shown = ", ".join(f"{k}={v}" for k, v in case.params.items() if not isinstance(v, (list, dict)) or len(v) <= 4)
    lines += _wrap(f"shapes and dtypes of a pinned case ({shown}):", "  ", "    ")
    received = _received(spec, case)
    if received is None:
        lines += _wrap(f"call (in each rank process): impl({', '.join(spec.arguments)})", "  ", "      ")
    else:
        optional = {name for name, text in zip(spec.arguments, declared(op)) if text.endswith("| None")}
        lines.append("  call: impl(")
        for name in (a for a in spec.arguments if a in received):
            form = _form(received[name], declared_dims.get(name, []))
            lines.append(f"      {name}={form}{' (or None)' if name in optional and received[name] is not None else ''},")
        lines.append("  )")
    if spec.writes:
        lines.append(f"  writes in place: {', '.join(spec.writes)} (nothing else may change); returns None")
    from mla_verify.equivalence.cases.layouts import layout_line

    lines += _wrap(layout_line(op) or "inputs drawn as built (dense, or the strided views the op's case builds)",
                   "  ", "    ")
    params = spec.params_of(case.params)
    ref = spec.reference(spec.inputs(params, case.seed, "cpu"), params)
    compared = [c for c in spec.checks if c.tensor in ref]
    if not spec.writes and received is not None:
        names = [c.tensor for c in compared if not c.optional]
        optional = "".join(f"[, {c.tensor}]" for c in compared if c.optional)
        form = names[0] if len(names) == 1 and not optional else f"({', '.join(names)}{optional})"
        lines.append(f"  returns: {form}")
    lines.append("  compared with the reference (bounds; a declared deviation widens them where it applies):")
    for c in compared:
        t = ref[c.tensor]
        dtype = str(c.dtype or t.dtype).removeprefix("torch.")
        shape = _form(t, [dims_of(op, c.tensor, [k.tensor for k in spec.checks]) or ()]).partition("[")[2][:-1]
        judged = params.numerics().replace(dcp_size=1) if c.single_rank else params.numerics()
        extra = " (optional)" if c.optional else ""
        lines.append(f"    {c.tensor:18s} {dtype}[{shape}]{extra}")
        rows = t[..., 0].numel() if t.dim() else 1
        held = f" (the {c.kind} bounds)" if c.kind != c.tensor else ""
        lines += _wrap(f"{c.tensor}{held}: {_bounds_text(c.kind, judged, rows, c.bound is not None)}", "      ",
                       "        ")
    if any(c.kind != EXACT for c in compared):
        lines.append("  every float tensor also: +inf/-inf/NaN exactly where the reference has them, no NaN added")
    return lines + (_stage_lines(op) if op == "forward_mqa" else [])


def describe_property(op: str) -> list[str]:
    """A property: its targets, each check and what it holds the implementation to."""
    from mla_verify.equivalence.catalog import get_spec
    from mla_verify.equivalence.judge.policy import PROPERTY_RULES

    prop = get_spec(op)
    lines = [*_wrap(f"{prop.name}: {prop.doc}", "", "  "), f"  targets (--path): {', '.join(prop.targets)}",
             f"  checks ({prop.tag.removeprefix('property: ')}):"]
    for check in prop.checks:
        rule = PROPERTY_RULES[f"{prop.short}.{check}"]
        lines += _wrap(f"{check}: " + ("bit for bit" if rule.bitwise else "; ".join(
            f"{kind}: " + ", ".join(f"{b.metric} <= {b.limit:.4g}" for b in bounds)
            for kind, bounds in rule.bounds.items())), "    ", "      ")
        lines += _wrap(rule.reason, "      ", "      ")
    return lines


def tolerance_lines(long: bool = False) -> list[str]:
    """Every bound of the policy, grouped by where it applies; each reason cut to the line
    (`long`: in full, wrapped). No line is wider than WIDTH."""
    from mla_verify.equivalence.judge.policy import all_bounds

    lines = ["tolerances: the largest value a correct implementation may show"
             + ("" if long else " (--long: the reasons in full)")]
    where_before = None
    for kind, where, b in all_bounds():
        if where != where_before:
            lines.append(f"  {where or 'default'}")
            where_before = where
        head = f"    {kind:5s} {b.metric:15s} <= {b.limit:<9.4g} "
        if long:
            lines.append(head.rstrip())
            lines += _wrap(b.reason, " " * 6, " " * 6)
        else:
            room = WIDTH - len(head)
            lines.append(head + (b.reason if len(b.reason) <= room else b.reason[:room - 3].rstrip() + "..."))
    return lines


def drift_lines(long: bool = False) -> list[str]:
    """The drift comparison's metrics (with the floors they are raised to before any ratio) and
    its option defaults, each with its reason cut to the line (`long`: in full). At most WIDTH."""
    from mla_verify.equivalence.judge.policy import BIAS_METRICS, DRIFT_DEFAULTS, DRIFT_METRICS

    def entry(head: str, reason: str) -> list[str]:
        if long:
            return [head.rstrip(), *_wrap(reason, " " * 6, " " * 6)]
        room = WIDTH - len(head)
        return [head + (reason if len(reason) <= room else reason[:room - 3].rstrip() + "...")]

    lines = ["drift against a baseline: metrics, raised to these floors before any ratio"]
    for m in DRIFT_METRICS:
        floors = ", ".join(f"{kind} {floor:.3g}" for kind, floor in m.floors.items())
        lines += entry(f"  {m.name:16s} {floors:22s} ", m.reason)
    lines.append("bias (alone: a warning; against a baseline: drift): the least |mean| or |shift| that counts")
    for m in BIAS_METRICS:
        floors = ", ".join(f"{kind} {floor:.3g}" for kind, floor in m.floors.items())
        lines += entry(f"  {m.name:16s} {floors:22s} ", f"({m.unit}) {m.reason}")
    for option, value, reason in DRIFT_DEFAULTS:
        lines += entry(f"  {option:12s} {value:<8g} ", reason)
    return lines


DESCRIBERS = {"op": describe_op, "property": describe_property}


def describe(op: str) -> list[str]:
    """What `mla-verify list --op OP` prints, by the spec's family (an op's call, a property's checks)."""
    from mla_verify.equivalence.catalog import get_spec

    return DESCRIBERS[get_spec(op).family](op)
