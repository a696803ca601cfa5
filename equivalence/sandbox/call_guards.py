"""What an implementation promises beyond its values: it leaves its inputs alone, returns what
the contract says (arity, type, dtype, shape, device), and never hands back an input as output.

Inputs are snapshotted before the call (a byte copy of every storage they live in, on their own
device) and compared after it, every byte: copied and compared as the widest integers that tile
the storage (an 8-byte word is one element: an eighth of the elements, and of the comparison's
mask, of a byte-wise compare), with one read back per device for all of a call's inputs (a
fuzz block's: for all of its cases, `changed_together`). An op that writes in place names the
arguments it may write (`OpSpec.writes`); its own checks compare every byte of them. A stage
inside a pipeline or a property gets the same checks through `guarded`. Every violation is a
`ContractError` or a one-line reason naming the tensor, never a traceback.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

import torch

from mla_verify.optimized.registry import Resolved

from ..errors import ContractError
from .guards import foreign, owned
from .invariants import broken


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a {str(obj.dtype).removeprefix('torch.')} tensor of shape {tuple(obj.shape)}"
    return f"a {type(obj).__name__}" if obj is not None else "None"


def returned(result: Any, names: Sequence[str], required: int | None = None) -> dict[str, Any]:
    """An implementation's result as {name: value}: one name, the result itself; several, a tuple
    (or list) of `required` to len(names) elements. Element types are checked per tensor later."""
    if len(names) == 1:
        return {names[0]: result}
    required = len(names) if required is None else required
    want = f"({', '.join(names[:required])}{''.join(f'[, {n}]' for n in names[required:])})"
    if not isinstance(result, (tuple, list)):
        raise ContractError(f"returned {_describe(result)}; the contract says a tuple {want}")
    if not required <= len(result) <= len(names):
        raise ContractError(f"returned a tuple of {len(result)}; the contract says {want}")
    return dict(zip(names, result))


def _shape_of(shape: Sequence[int], dims: Sequence[str] | None) -> str:
    """"(B=1, H=8, S=1)": a shape with its contract's dimension names (a fixed width, 512, as is)."""
    if dims is None or len(dims) != len(shape):
        return str(tuple(shape))
    return "(" + ", ".join(str(n) if d.isdigit() else f"{d}={n}" for d, n in zip(dims, shape)) + ")"


def output_problem(name: str, t: Any, *, dtype: torch.dtype | None, shape: Sequence[int] | None, device: str | None,
                   contiguous: bool = False, returned_on: str | None = None,
                   returned_strides: Sequence[int] | None = None, dims: Sequence[str] | None = None) -> str | None:
    """Why output `name` breaks its contract (one line), or None. `device`, `dtype`, `shape` None:
    not checked. `returned_on`, `returned_strides`: the device it was returned on and, where they
    were not contiguous, its strides, where `t` is a copy on the host (a copy is contiguous).
    `dims`: the contract's names of its dimensions ("B", "H", "S"), which a wrong shape is said in."""
    if not isinstance(t, torch.Tensor):
        return f"{name}: {_describe(t)}, the contract says a torch.Tensor"
    odd = foreign(name, t)
    if odd:
        return odd
    if device is not None:
        want, got = torch.device(device), torch.device(returned_on) if returned_on else t.device
        if got.type != want.type or (want.index is not None and got.index not in (None, want.index)):
            return f"{name}: on device {got}, the contract says {want}"
    if dtype is None:
        return None
    if t.dtype != dtype:
        return f"{name}: dtype {str(t.dtype).removeprefix('torch.')}, the contract says {str(dtype).removeprefix('torch.')}"
    if tuple(t.shape) != tuple(shape):
        return f"{name}: shape {tuple(t.shape)}, the contract says {_shape_of(shape, dims)}"
    if contiguous and (returned_strides is not None or not t.is_contiguous()):
        return f"{name}: strides {tuple(returned_strides or t.stride())} are not contiguous, the contract says contiguous"
    return None


def tensors_in(obj: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in an argument: tensors, tuples/lists, dicts, dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            yield from tensors_in(x, f"{name}[{i}]")
    elif isinstance(obj, Mapping):
        for k, x in obj.items():
            yield from tensors_in(x, f"{name}.{k}")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name), f"{name}.{f.name}")


WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}  # bytes -> integer of that width


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same elements as integers of the same width: compared bit for bit, NaN equal to NaN."""
    width = WORDS[t.element_size()]
    return t if t.dtype == width or t.dtype == torch.bool else t.view(width)


def _storage_as(storage: torch.UntypedStorage, device: torch.device, width: int) -> torch.Tensor:
    return torch.empty(0, dtype=WORDS[width], device=device).set_(storage, 0, (storage.nbytes() // width,), (1,))


def _storage_words(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """Every byte of `storage` as the widest aligned integers that tile it."""
    width = next(w for w in WORDS if storage.nbytes() % w == 0 and storage.data_ptr() % w == 0)
    return _storage_as(storage, device, width)


def _unchanged(saved: list["_Saved"]) -> list[bool]:
    """Whether each saved storage still holds its copy's bytes (one resized in place does not):
    the comparisons of one device are stacked and read back at once (a GPU waits once, not once
    per input)."""
    same: list = [s.storage.nbytes() == s.copy.nbytes and s.words.eq(s.copy).all() for s in saved]
    by_device: dict[torch.device, list[int]] = {}
    for i, flag in enumerate(same):
        if isinstance(flag, torch.Tensor):
            by_device.setdefault(flag.device, []).append(i)
    for at in by_device.values():
        for i, flag in zip(at, torch.stack([same[i] for i in at]).tolist()):
            same[i] = flag
    return same


def _value(t: torch.Tensor, at: tuple[int, ...]) -> str:
    v = t[at].item()
    return f"{v:.6g}" if isinstance(v, float) else str(v)


@dataclass
class _Saved:
    storage: torch.UntypedStorage
    words: torch.Tensor                                  # every byte of it (`_storage_words`), as it is now
    copy: torch.Tensor                                   # the same words as they were
    views: list[tuple[str, str, torch.Tensor]]          # (argument, path, tensor) of each that lives in it


class Snapshot:
    """Every tensor of `arguments`, copied byte for byte (whole storages: padding between the
    rows of a strided view counts) before an implementation runs."""

    def __init__(self, arguments: Mapping[str, Any]):
        self._saved: dict[tuple[str, int], _Saved] = {}
        self._written: list[_Saved] = []
        for name, value in arguments.items():
            for path, t in tensors_in(value, name):
                if t.device.type == "meta" or t.layout != torch.strided or t.untyped_storage().nbytes() == 0:
                    continue
                storage = t.untyped_storage()
                key = (t.device.type, storage.data_ptr())
                if key not in self._saved:
                    words = _storage_words(storage, t.device)
                    self._saved[key] = _Saved(storage, words, words.clone(), [])
                self._saved[key].views.append((name, path, t))

    def changed(self, allowed: Collection[str] = ()) -> list[tuple[str, str]]:
        """(argument, one-line reason) for every argument written since the snapshot; arguments
        named in `allowed` (and anything sharing their storage) may change."""
        return changed_together([self], allowed)[0]

    def _checked(self, allowed: Collection[str]) -> list[_Saved]:
        return [saved for saved in self._saved.values()
                if not any(argument in allowed for argument, _, _ in saved.views)]

    def put_back(self) -> None:
        """Copy the saved bytes back into every storage the last `changed` found written (resized
        back first where a call resized it): what a reference computed next reads is what the
        call was given."""
        for saved in self._written:
            if saved.storage.nbytes() != saved.copy.nbytes:
                saved.storage.resize_(saved.copy.nbytes)
            _storage_as(saved.storage, saved.copy.device, saved.copy.element_size()).copy_(saved.copy)
        self._written = []

    def _locate(self, saved: _Saved) -> tuple[str, str]:
        ro = "inputs are read-only"
        for _, path, t in saved.views:
            before = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                saved.copy.untyped_storage(), t.storage_offset(), t.size(), t.stride())
            diff = (_bits(before) != _bits(t)).nonzero()
            if len(diff):
                at = tuple(int(i) for i in diff[0])
                where = ", ".join(map(str, at))
                return path, (f"{path}: input written by the implementation at [{where}] "
                              f"({_value(before, at)} -> {_value(t, at)}; {len(diff)} elements changed); {ro}")
        now, before = _storage_as(saved.storage, saved.copy.device, 1), _storage_as(saved.copy.untyped_storage(), saved.copy.device, 1)
        common = min(len(now), len(before))  # a storage resized in place differs past the shorter one
        diff = (now[:common] != before[:common]).nonzero()
        byte = int(diff[0]) if len(diff) else common
        path = saved.views[0][1]
        return path, (f"{path}: bytes outside the tensor's view written (storage byte {byte}, e.g. the padding "
                      f"between cache blocks); {ro}")

    def aliased_by(self, name: str, out: Any) -> str | None:
        """A reason if output `name` shares memory with a saved tensor (writing it would write an
        input; being it would judge the reference against itself)."""
        if (not isinstance(out, torch.Tensor) or out.layout != torch.strided or out.device.type == "meta"
                or out.untyped_storage().nbytes() == 0):
            return None
        saved = self._saved.get((out.device.type, out.untyped_storage().data_ptr()))
        if saved is None:
            return None
        return f"{name}: shares memory with input {saved.views[0][1]} (an output must be a new tensor)"


def changed_together(snapshots: Sequence[Snapshot], allowed: Collection[str] = ()) -> list[list[tuple[str, str]]]:
    """`Snapshot.changed` of each of `snapshots` (a block's cases), compared with one read back
    per device for all of them."""
    checked = [snapshot._checked(allowed) for snapshot in snapshots]
    flags = iter(_unchanged([saved for each in checked for saved in each]))
    found = []
    for snapshot, each in zip(snapshots, checked):
        snapshot._written = [saved for saved in each if not next(flags)]
        found.append([snapshot._locate(saved) for saved in snapshot._written])
    return found


def _outputs(result: Any) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(result, (tuple, list)):
        for i, x in enumerate(result):
            if isinstance(x, torch.Tensor):
                yield f"output {i}", x
    elif isinstance(result, torch.Tensor):
        yield "output", result


# The keywords (passed, not None) each stage was called with in this process: what a pipeline or
# property campaign exercised of a stage a user replaced (`subject.unexercised`).
CALLED_WITH: dict[str, set[str]] = collections.defaultdict(set)


def guard(stage: str, name: str, fn: Callable, writes: Collection[str] = (), views: bool = False) -> Callable:
    """`fn` (implementation `name` of `stage`) with its inputs snapshotted and compared after the
    call, its outputs checked for being plain dense tensors that alias no input, and handed on as
    copies of their own (`guards.owned`): a stage returning its static buffer every call would
    otherwise overwrite what a pipeline or a property holds from its previous call, and its
    metadata invariants checked (`sandbox.invariants`). A violation raises ContractError, naming
    the stage."""

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        saved = Snapshot({**{f"argument {i}": a for i, a in enumerate(args)}, **kwargs})
        CALLED_WITH[stage].update(k for k, v in kwargs.items() if v is not None)
        result = fn(*args, **kwargs)
        problems = [reason for _, reason in saved.changed(writes)]
        problems += [p for out_name, t in _outputs(result) if (p := foreign(out_name, t))]
        if not views:
            problems += [p for out_name, t in _outputs(result) if (p := saved.aliased_by(out_name, t))]
        problems += [why] if (why := broken(stage, kwargs, result)) else []
        if problems:
            raise ContractError(f"stage {stage} ({name}): {problems[0]}")
        return result if views else owned(result)

    return checked


def guarded(stages: Resolved, op_of: Callable[[str], Any]) -> Resolved:
    """`stages` with every chosen implementation wrapped by `guard` (its op's declared writes and
    views: `op_of(stage)`, the spec of the op a stage is, None for a pipeline-internal stage)."""
    def wrap(stage: str, impl):
        op = op_of(stage)
        fn = guard(stage, impl.name, impl.fn, op.writes if op else (), op.views if op else False)
        return dataclasses.replace(impl, fn=fn)

    return Resolved({s: wrap(s, impl) for s, impl in stages.chosen.items()}, stages.fallbacks)
