"""What crosses between an isolation worker and its parent: data, never code.

The worker runs the user's code, so what it sends is read as a server reads a request: a fixed
frame, a JSON header and raw tensor bytes, decoded by a strict parser with size bounds, and
nothing in it is ever unpickled or called. A message is

    MAGIC (4 bytes) | header length (uint32, big-endian) | header (UTF-8 JSON object)
    | the bytes of each tensor the header lists, in order

and its header holds `kind`, `seq` (the number of the parent's request it answers) and, per
tensor, its dtype (one of DTYPES), shape, device and byte length. Where the parent gave the worker
an outputs segment (`equivalence.sandbox.segment`) and the tensors fit, their bytes are there instead and
each description adds its `offset`: the parent checks every region lies within the segment and
overlaps no other, and copies each out as the answer arrives (what the worker writes there after
never reaches a verdict). The parent reads with a
deadline and watches the worker's process while it waits (`Reader`): a frame that does not parse,
a worker that stops mid-message or answers out of sequence is `Unreadable`, which the parent turns
into the case's `crashed` finding.

The parent's requests go the other way as JSON (`Connection.send_bytes`): a Case is data too.
"""

from __future__ import annotations

import json
import math
import os
import select
import struct
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from . import segment

MAGIC = b"MLAw"
_FRAME = struct.Struct("!4sI")
HEADER_LIMIT = 4 << 20        # bytes of a header: names, reasons, notes; never tensors
TENSOR_LIMIT = 32 << 30       # bytes of one tensor: above any case a budget admits
MESSAGE_LIMIT = 64 << 30      # bytes of a message's tensors together
MAX_DIMS, MAX_TENSORS, TEXT_LIMIT = 8, 256, 64 << 10
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)}
DEVICES = ("cpu", "cuda", "meta")


class Unreadable(Exception):
    """A message that does not parse, arrives out of sequence or stops midway: the reason."""


class Message(StrEnum):
    """A message's `kind`, and what the parent reads in the place of one."""

    READY = "ready"          # the worker started, behind what it says (before any user code)
    RESOLVED = "resolved"    # it imported the implementation asked for
    USAGE = "usage"          # it could not: the user's error, in one line
    CALLING = "calling"      # a case's inputs are built: its implementation is called now
    PRODUCED = "produced"    # a case's answer (`equivalence.sandbox.produced.Produced.to_header`)
    CRASHED = "crashed"      # its CUDA context died once the implementation ran: it exits
    ERROR = "error"          # the harness failed in the worker (its traceback)
    AFTER = "after"          # its check of the last case's outputs for a write after return
    # the parent's reading where no message came
    TIMEOUT = "timeout"
    DIED = "died"
    UNREADABLE = "unreadable"


# ----------------------------------------------------------------------------- the worker's side


def sendable(t: torch.Tensor) -> str | None:
    """Why `t` cannot cross as it is (a dtype off the list), or None."""
    return None if str(t.dtype).removeprefix("torch.") in DTYPES else f"dtype {t.dtype} is not one a judge receives"


def encode(header: dict[str, Any], tensors: list[torch.Tensor], into: Any = None) -> list[memoryview | bytes]:
    """The frames of a message: `header` with a description of each of `tensors` (host or meta
    tensors; each sent as its contiguous bytes) added under "tensors", then their bytes; or, where
    they fit the outputs segment `into` (`segment.Mapped`), their bytes written there and their
    offsets described."""
    described, payloads = [], []
    offsets = segment.place(tensors, into)
    for i, t in enumerate(tensors):
        t = t.detach()
        device = t.device.type
        if device != "meta" and offsets is None:
            t = t.contiguous()
            payloads.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"")
        described.append(dict(dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), device=device,
                              nbytes=0 if device == "meta" else t.numel() * t.element_size(),
                              **({"offset": offsets[i]} if offsets is not None and device != "meta" else {})))
    body = json.dumps({**header, "tensors": described}, allow_nan=True).encode()
    return [_FRAME.pack(MAGIC, len(body)) + body, *payloads]


def write(fd: int, frames: list[memoryview | bytes]) -> None:
    for frame in frames:
        view = memoryview(frame).cast("B")
        while view:
            view = view[os.write(fd, view):]


# ----------------------------------------------------------------------------- the parent's side


@dataclass
class Reader:
    """Reads the worker's messages from `fd` within a deadline, while `alive()` says the worker
    process lives (its sentinel): a worker that died is not waited for, even where a process it
    forked still holds the pipe open."""

    fd: int
    sentinel: int
    segment: Any = None  # the worker's outputs segment (`segment.Segment`), mapped read-only here
    piped: int = 0       # the most bytes of one message's tensors that came through the pipe

    def wait(self, timeout_s: float) -> Message | None:
        """None once the pipe has something to read, DIED when the worker exited with nothing left
        to read, TIMEOUT after `timeout_s`."""
        ready, _, _ = select.select([self.fd, self.sentinel], [], [], max(0.0, timeout_s))
        if self.fd in ready:
            return None
        return Message.DIED if ready else Message.TIMEOUT

    def _exact(self, n: int, deadline: float, into: memoryview | None = None) -> bytes | memoryview:
        buf = into if into is not None else memoryview(bytearray(n))
        got = 0
        while got < n:
            ready, _, _ = select.select([self.fd, self.sentinel], [], [], max(0.0, deadline - time.monotonic()))
            if self.fd not in ready:
                why = "the worker died" if ready else "it stopped"
                raise Unreadable(f"{why} mid-message ({got} of {n} bytes in the time allowed)")
            try:
                k = os.readv(self.fd, [buf[got:]])
            except OSError as exc:
                raise Unreadable(f"the pipe failed mid-message ({exc.strerror or exc})") from None
            if k == 0:
                raise Unreadable(f"the pipe closed mid-message ({got} of {n} bytes)")
            got += k
        return buf

    def read(self, deadline: float) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """(header, tensors) of the next message, whose first byte is there to read; Unreadable
        otherwise. A closed pipe before the first byte is EOFError."""
        first = os.read(self.fd, _FRAME.size)
        if not first:
            raise EOFError
        if len(first) < _FRAME.size:
            first += bytes(self._exact(_FRAME.size - len(first), deadline))
        magic, length = _FRAME.unpack(first)
        if magic != MAGIC:
            raise Unreadable(f"it does not start as a message does ({magic!r})")
        if length > HEADER_LIMIT:
            raise Unreadable(f"its header claims {length} bytes, over the {HEADER_LIMIT} allowed")
        try:
            header = json.loads(bytes(self._exact(length, deadline)).decode())
        except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, an integer of 5000 digits
            raise Unreadable(f"its header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise Unreadable("its header is not a JSON object")
        specs = [_tensor_spec(d) for d in listed(header.get("tensors", []), "tensors", MAX_TENSORS)]
        if sum(nbytes for *_, nbytes, offset in specs if offset is None) > MESSAGE_LIMIT:
            raise Unreadable(f"its tensors claim more than {MESSAGE_LIMIT} bytes together")
        _regions(specs, self.segment)
        self.piped = max(self.piped, sum(nbytes for *_, nbytes, offset in specs if offset is None))
        tensors = []
        for dtype, shape, device, nbytes, offset in specs:
            if device == "meta":
                tensors.append(torch.empty(shape, dtype=dtype, device="meta"))
                continue
            t = torch.empty(shape, dtype=dtype)
            if nbytes and offset is None:
                self._exact(nbytes, deadline, memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            elif nbytes:  # copied now: the worker may write the segment again, the judge reads this copy
                memoryview(t.reshape(-1).view(torch.uint8).numpy())[:] = self.segment.view[offset:offset + nbytes]
            tensors.append(t)
        header["tensors"] = tensors
        return header, tensors


def _regions(specs: list[tuple], segment: Any) -> None:
    """Unreadable unless every tensor said to be in the outputs segment lies within it, overlapping
    no other: checked before anything is allocated or copied."""
    spans = sorted((offset, nbytes) for *_, nbytes, offset in specs if offset is not None)
    if spans and segment is None:
        raise Unreadable("it places tensors in a shared segment it was not given")
    end = 0
    for offset, nbytes in spans:
        if offset + nbytes > segment.size:
            raise Unreadable(f"a tensor of {nbytes} bytes at offset {offset} ends past the shared segment's "
                             f"{segment.size} bytes")
        if offset < end:
            raise Unreadable(f"two tensors overlap in the shared segment (at byte {offset})")
        end = max(end, offset + nbytes)


def _tensor_spec(d: Any) -> tuple[torch.dtype, list[int], str, int, int | None]:
    if not isinstance(d, dict):
        raise Unreadable("a tensor's description is not an object")
    dtype = DTYPES.get(d.get("dtype")) if isinstance(d.get("dtype"), str) else None
    if dtype is None:
        raise Unreadable(f"a tensor's dtype {str(d.get('dtype'))[:40]!r} is not one of {', '.join(DTYPES)}")
    shape = listed(d.get("shape"), "shape", MAX_DIMS)
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= TENSOR_LIMIT for n in shape):
        raise Unreadable(f"a tensor's shape {shape} is not a list of sizes up to {TENSOR_LIMIT}")
    device, nbytes = d.get("device"), d.get("nbytes")
    if device not in DEVICES:
        raise Unreadable(f"a tensor's device {str(device)[:40]!r} is not one of {', '.join(DEVICES)}")
    want = 0 if device == "meta" else math.prod(shape) * dtype.itemsize
    if nbytes != want or want > TENSOR_LIMIT:
        raise Unreadable(f"a tensor of shape {shape} and {dtype} claims {str(nbytes)[:40]} bytes "
                         f"(it has {want}; at most {TENSOR_LIMIT})")
    offset = d.get("offset")
    if offset is not None and (isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= MESSAGE_LIMIT
                               or device == "meta"):
        raise Unreadable(f"a tensor's offset {str(offset)[:40]} is not a place in a shared segment")
    return dtype, shape, device, want, offset


def listed(v: Any, what: str, limit: int) -> list:
    if not isinstance(v, list) or len(v) > limit:
        raise Unreadable(f"its {what} is not a list of at most {limit}")
    return v


def text(header: dict[str, Any], key: str, default: str | None = "") -> str | None:
    """header[key] as a string of bounded length (`default` where absent or null)."""
    v = header.get(key)
    if v is None:
        return default
    if not isinstance(v, str) or len(v) > TEXT_LIMIT:
        raise Unreadable(f"its {key!r} is not a string of at most {TEXT_LIMIT} characters")
    return v


def texts(v: Any, what: str) -> list[str]:
    """A list of bounded strings."""
    items = listed(v if v is not None else [], what, 4096)
    if not all(isinstance(s, str) and len(s) <= TEXT_LIMIT for s in items):
        raise Unreadable(f"its {what} is not a list of strings")
    return items


def number(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise Unreadable(f"its {what} is not a number")
    return float(v)


# ----------------------------------------------------------------------------- a pipeline's stage calls

CALL_FIELDS = ("stage", "impl", "deviations", "rank", "kwargs", "result")  # `equivalence.ops.stages.Call`'s
MAX_DEPTH, MAX_ITEMS = 4, 4096


def calls_out(runs: tuple[list[dict], list[dict]], tensors: list[torch.Tensor]) -> list:
    """A pipeline's stage calls (`Produced.stage_calls`: two runs of calls as dicts) as data, their
    tensors appended to `tensors` (one a tensor, however many calls were handed it); [] where
    they do not fit a message (MAX_TENSORS) or hold a value that is not data."""
    at: dict[int, int] = {}
    added: list[torch.Tensor] = []

    def value(v: Any, depth: int = 0) -> Any:
        if isinstance(v, torch.Tensor):
            if id(v) not in at:
                at[id(v)] = len(tensors) + len(added)
                added.append(v)
            return {"tensor": at[id(v)]}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (list, tuple)) and depth < MAX_DEPTH:
            return {"items": [value(x, depth + 1) for x in v], "tuple": isinstance(v, tuple)}
        raise ValueError(type(v).__name__)

    try:
        runs_out = [[{**{k: c[k] for k in ("stage", "impl", "rank")}, "deviations": list(c["deviations"]),
                      "kwargs": {k: value(v) for k, v in c["kwargs"].items()}, "result": value(c["result"])}
                     for c in run] for run in runs]
    except ValueError:
        return []
    if len(tensors) + len(added) > MAX_TENSORS or any(sendable(t) for t in added):
        return []
    tensors.extend(added)
    return runs_out


def calls_in(v: Any, tensor, known_deviations: Any) -> tuple[list[dict], list[dict]]:
    """`calls_out`'s data read back strictly: two runs of calls as dicts; Unreadable otherwise."""
    def value(x: Any, depth: int = 0) -> Any:
        if isinstance(x, dict) and set(x) == {"tensor"}:
            return tensor(x["tensor"])
        if isinstance(x, dict) and set(x) == {"items", "tuple"} and depth < MAX_DEPTH:
            items = [value(y, depth + 1) for y in listed(x["items"], "a stage value", MAX_ITEMS)]
            return tuple(items) if x["tuple"] is True else items
        if x is None or isinstance(x, (bool, int, float)) or (isinstance(x, str) and len(x) <= TEXT_LIMIT):
            return x
        raise Unreadable("a stage call holds a value that is not data")

    def call(c: Any) -> dict:
        if not isinstance(c, dict) or set(c) != set(CALL_FIELDS):
            raise Unreadable(f"a stage call is not an object of {', '.join(CALL_FIELDS)}")
        rank = c["rank"]
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise Unreadable("a stage call's rank is not an integer")
        deviations = texts(c["deviations"], "a stage call's deviations")
        if unknown := [d for d in deviations if d not in known_deviations]:
            raise Unreadable(f"a stage call declares deviations {unknown[:3]} that mla-verify does not know")
        kwargs = c["kwargs"]
        if not isinstance(kwargs, dict) or len(kwargs) > 64:
            raise Unreadable("a stage call's keywords are not an object")
        return dict(stage=text(c, "stage"), impl=text(c, "impl"), deviations=tuple(deviations), rank=rank,
                    kwargs={name(k): value(x) for k, x in kwargs.items()}, result=value(c["result"]))

    runs = listed(v, "stage_calls", 2)
    if not runs:
        return [], []
    if len(runs) != 2:
        raise Unreadable("its stage calls are not two runs")
    plain, fed = ([call(c) for c in listed(run, "a run's stage calls", MAX_ITEMS)] for run in runs)
    return plain, fed


def after_of(header: dict[str, Any]) -> tuple[str, list[str]] | None:
    """(case id, the outputs it wrote after returning) of the worker's check of its last case, or
    None; Unreadable when malformed."""
    after = header.get("after")
    if after is None:
        return None
    if not isinstance(after, dict):
        raise Unreadable("its 'after' is not an object")
    return text(after, "case_id"), [name(n) for n in texts(after.get("changed"), "changed")]


def pairs(v: Any) -> tuple[tuple[str, str], ...]:
    """A pipeline's stages as sent, [[stage, impl], ...]: pairs of bounded strings."""
    sent = listed(v if v is not None else [], "stages", MAX_ITEMS)
    if not all(isinstance(p, list) and len(p) == 2 for p in sent):
        raise Unreadable("its stages are not [stage, implementation] pairs")
    return tuple((name(s), name(i)) for s, i in (texts(p, "stages") for p in sent))


def name(k: str) -> str:
    if len(k) > 200:
        raise Unreadable("a name is over 200 characters")
    return k


def mapping(v: Any) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict) or len(v) > 4096:
        raise Unreadable("a field is not an object")
    return v


def strings(v: Any) -> dict[str, str]:
    d = mapping(v)
    if not all(isinstance(s, str) and len(s) <= TEXT_LIMIT for s in d.values()):
        raise Unreadable("a field is not an object of strings")
    return {name(k): s for k, s in d.items()}


def ints(v: Any) -> list[int]:
    items = listed(v, "strides", MAX_DIMS)
    if not all(isinstance(n, int) and not isinstance(n, bool) and abs(n) <= TENSOR_LIMIT for n in items):
        raise Unreadable("its strides are not integers")
    return items
