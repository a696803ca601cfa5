"""Shared memory between an isolation worker and its parent: a case's inputs go to the worker and
its outputs come back through segments the parent owns, not through the pipe.

A segment is an anonymous memory file (memfd) the parent creates, sized, then sealed against
growing and shrinking: no process can resize it after, so a worker cannot make the parent's
mapping fault (SIGBUS) by truncating it, and it has no name a worker could unlink. The worker
opens it through /proc/<parent>/fd/<fd>, a path the parent sends in its JSON request. The parent
maps its outputs segment read-only and copies each tensor out when the answer arrives
(`wire.Reader`): what the worker writes there after answering never reaches a verdict. Where
memfd or sealing is not available, `Segment.create` says None and the pipe carries everything.

Inputs (`hand_over`, `inputs_of`): the parent writes each storage of a case's inputs (whole
storages: padding between strided rows and a view's offset cross as built) and describes the
arguments as JSON; the worker's arguments are views of that memory (on CUDA, one copy to the
device). After the call the parent compares the segment with its own inputs (`written`): a
kernel that wrote its inputs is caught by the judge, whatever the worker says.
"""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import socket
from dataclasses import dataclass
from typing import Any, Collection

import torch

from .call_guards import tensors_in
from .device import is_cuda

ALIGN = 64                   # every region starts at a multiple: any dtype's view is aligned
INITIAL_BYTES = 64 << 20     # a memfd's pages exist once written: an unused size costs nothing
SEALS = ("F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_SEAL")
_serial = itertools.count(1)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _bytes_at(memory: mmap.mmap, offset: int, nbytes: int) -> torch.Tensor:
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(memory, dtype=torch.uint8, count=nbytes, offset=offset)


class Segment:
    """A sealed memfd of `size` bytes, mapped here (read-only for a worker's outputs)."""

    def __init__(self, fd: int, size: int, writable: bool):
        self.fd, self.size, self.serial = fd, size, next(_serial)
        self.map = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        self.view = memoryview(self.map)

    @classmethod
    def create(cls, size: int, writable: bool) -> "Segment | None":
        """A new segment of at least `size` bytes, or None where this system cannot seal one."""
        if not hasattr(os, "memfd_create") or not all(hasattr(fcntl, s) for s in SEALS):
            return None
        size = max(ALIGN, aligned(size))
        fd = os.memfd_create("mla-verify", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            return cls(fd, size, writable)
        except OSError:
            os.close(fd)
            return None

    def describe(self) -> dict:
        """What the worker is told: its size and a serial that changes with it (its descriptor is
        handed over beside the request that first names the serial: `send_handles`)."""
        return {"size": self.size, "serial": self.serial}

    def bytes_at(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) as a uint8 tensor on this memory (a writable segment)."""
        return _bytes_at(self.map, offset, nbytes)

    def close(self) -> None:
        self.view.release()
        try:
            self.map.close()
        except BufferError:  # a tensor still views it: unmapped when that goes
            pass
        os.close(self.fd)


def grown(segment: Segment | None, need: int, writable: bool) -> Segment | None:
    """`segment` where it holds `need` bytes, else a new one twice that (the old one closed)."""
    if segment is not None and segment.size >= need:
        return segment
    if segment is not None:
        segment.close()
    return Segment.create(max(INITIAL_BYTES, 2 * need), writable)


def send_handles(sock: socket.socket, segments: list[Segment]) -> None:
    """The descriptors of `segments` to the worker at the other end of `sock` (SCM_RIGHTS), sent
    right after the request that names their serials under "handles"."""
    if segments:
        socket.send_fds(sock, [b"S"], [s.fd for s in segments])


class Handles:
    """The worker's side of `send_handles`: serial -> descriptor of each segment handed over."""

    def __init__(self, fd: int):
        self.sock = socket.socket(fileno=os.dup(fd))  # the worker's end of its pipe, for recvmsg
        self.fds: dict[int, int] = {}

    def receive(self, serials: list) -> None:
        """The descriptors the parent sent for `serials` (the request's "handles"), in order."""
        if not serials:
            return
        data, fds, _, _ = socket.recv_fds(self.sock, 1, len(serials))
        if data == b"S" and len(fds) == len(serials):
            self.fds.update(zip(serials, fds))
            return
        for fd in fds:  # not what was named: none is mapped (`mapping` falls back to the pipe)
            os.close(fd)

    def take(self, serial: int) -> int | None:
        """The descriptor of segment `serial`, now the caller's to close; None where none came."""
        return self.fds.pop(serial, None)


class Mapped:
    """The worker's mapping of a segment the parent described (`Segment.describe`), through the
    descriptor it handed over (kept open while mapped)."""

    def __init__(self, described: dict, fd: int):
        self.serial, self.size, self.fd = described["serial"], described["size"], fd
        if os.fstat(fd).st_size != self.size:
            raise OSError(f"segment {self.serial} is not of {self.size} bytes")
        self.map = mmap.mmap(fd, self.size)
        self.view = memoryview(self.map)

    def bytes_at(self, offset: int, nbytes: int) -> torch.Tensor:
        return _bytes_at(self.map, offset, nbytes)

    def close(self) -> None:
        """Let go of the descriptor (the mapping goes once nothing views it)."""
        os.close(self.fd)


def mapping(kept: Mapped | None, described: dict | None, handles: Handles) -> Mapped | None:
    """`kept` where it is the segment `described`, else a new mapping of it (`kept` let go); None
    where none is described or its descriptor did not come: then the pipe carries the outputs and
    the worker builds the inputs, as without segments."""
    if described is None:
        return None
    if kept is not None and kept.serial == described["serial"] and kept.size == described["size"]:
        return kept
    fd = handles.take(described["serial"])
    if fd is None:
        return None
    if kept is not None:
        kept.close()
    try:
        return Mapped(described, fd)
    except OSError:
        os.close(fd)
        return None


# ----------------------------------------------------------------------------- outputs (the worker's)


def place(tensors: list[torch.Tensor], into: Mapped | None) -> list[int] | None:
    """Each host tensor of `tensors` written into `into` (offsets, in order; None for a meta
    tensor), or None where they do not fit or there is no segment: the pipe carries them."""
    sizes = [0 if t.device.type == "meta" else t.numel() * t.element_size() for t in tensors]
    if into is None or sum(aligned(n) for n in sizes) > into.size:
        return None
    offsets, at = [], 0
    for t, n in zip(tensors, sizes):
        if t.device.type == "meta":
            offsets.append(None)
            continue
        if n:
            into.bytes_at(at, n).copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        offsets.append(at)
        at += aligned(n)
    return offsets


# ----------------------------------------------------------------------------- inputs (the parent's)


@dataclass
class Handed:
    """A case's inputs as written into the parent's inputs segment: the request's description and,
    per storage region, (offset, the parent's own bytes, the (argument, path) of each view of it)."""

    described: dict
    regions: list[tuple[int, torch.Tensor, list[tuple[str, str]]]]


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _value(v: Any, depth: int, tensor) -> Any:
    """An argument as JSON (tensors by `tensor(t)`), or ValueError where it is not data."""
    if isinstance(v, torch.Tensor):
        return {"tensor": tensor(v)}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)) and depth < 4:
        return {"items": [_value(x, depth + 1, tensor) for x in v], "tuple": isinstance(v, tuple)}
    raise ValueError(type(v).__name__)


def hand_over(kwargs: dict[str, Any], segment: Segment | None) -> tuple[Segment | None, Handed | None]:
    """`kwargs` written into `segment` (grown as needed: the segment returned is the one to keep)
    and described; (segment, None) where an argument is not plain data and tensors (a Batch), a
    tensor is not a dense one, or there is no segment: the worker then builds its inputs."""
    storages: dict[tuple[str, int], int] = {}
    regions: list[tuple[torch.Tensor, list[tuple[str, str]]]] = []
    paths = {id(t): (name, p) for name, v in kwargs.items() for p, t in tensors_in(v, name)}

    def tensor(t: torch.Tensor) -> dict:
        if t.layout != torch.strided or t.device.type == "meta":
            raise ValueError("not a dense tensor")
        key = (str(t.device), t.untyped_storage().data_ptr())
        if key not in storages:
            storages[key] = len(regions)
            regions.append((_storage_bytes(t), []))
        regions[storages[key]][1].append(paths[id(t)])
        return dict(storage=storages[key], dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                    stride=list(t.stride()), offset=t.storage_offset())

    try:
        values = {name: _value(v, 0, tensor) for name, v in kwargs.items()}
    except ValueError:
        return segment, None
    segment = grown(segment, sum(aligned(b.numel()) for b, _ in regions), writable=True)
    if segment is None:
        return None, None
    placed, at = [], 0
    for parent_bytes, views in regions:
        segment.bytes_at(at, parent_bytes.numel()).copy_(parent_bytes)
        placed.append((at, parent_bytes, views))
        at += aligned(parent_bytes.numel())
    described = {"segment": segment.describe(), "storages": [[o, b.numel()] for o, b, _ in placed], "values": values}
    return segment, Handed(described, placed)


def written(segment: Segment, handed: Handed, allowed: Collection[str]) -> list[tuple[str, str]]:
    """(argument, reason) for every input region the worker's call changed, against the parent's
    own copy (regions an argument of `allowed` views may change: written in place by contract).
    On CUDA the worker's call wrote its device copy, never the segment: its own snapshot tells."""
    found = []
    for offset, parent_bytes, views in handed.regions:
        if parent_bytes.device.type != "cpu" or any(argument in allowed for argument, _ in views):
            continue
        now = segment.bytes_at(offset, parent_bytes.numel())
        if not torch.equal(now, parent_bytes):
            byte, path = int((now != parent_bytes).nonzero()[0]), views[0][1]
            found.append((path, f"{path}: input written by the implementation (storage byte {byte} of what the "
                                "judge handed over differs from its own copy); inputs are read-only"))
    return found


# ----------------------------------------------------------------------------- inputs (the worker's)


def inputs_of(described: dict, mapped: Mapped, device: str) -> dict[str, Any]:
    """The arguments `hand_over` described, each tensor a view of `mapped` (on a CUDA `device`:
    of one copy of each storage on the device)."""
    storages = [mapped.bytes_at(o, n) for o, n in described["storages"]]
    if is_cuda(device):
        storages = [s.to(device) for s in storages]

    def value(v: Any) -> Any:
        if isinstance(v, dict) and "tensor" in v:
            d = v["tensor"]
            storage, dtype = storages[d["storage"]], getattr(torch, d["dtype"])  # the parent's words: trusted
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{d['dtype']} is not a dtype")
            return torch.empty(0, dtype=dtype, device=storage.device).set_(
                storage.untyped_storage(), d["offset"], d["shape"], d["stride"])
        if isinstance(v, dict):
            items = [value(x) for x in v["items"]]
            return tuple(items) if v["tuple"] else items
        return v

    return {name: value(v) for name, v in described["values"].items()}
