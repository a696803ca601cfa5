"""Real multi-process DCP: N rank processes on torch.distributed run one case's protocol each on
their own shard; the parent gets back what every rank received.

Where the ranks run (`placement`):
  cpu                       gloo; every rank on the CPU (Triton under its interpreter).
  cuda with >= N GPUs       nccl; rank r on cuda:r, one process per GPU. NVLink multicast stays
                            off in every rank (`NO_MULTICAST`: NCCL_NVLS_ENABLE=0 and friends).
  cuda with fewer GPUs      gloo; rank r computes on cuda:(r mod GPUs) and its collectives stage
                            through host memory. NCCL cannot hold two ranks on one GPU, and
                            running ranks one after another cannot work: every collective needs
                            all ranks at once. So on a single GPU all ranks share it; kernels run
                            compiled, only the wire differs (a host bf16 sum in the reduce-scatter).
Rendezvous is a FileStore in a private temporary directory (no TCP store, no port chosen by us);
gloo's pairs and NCCL's bootstrap sockets bind the loopback interface only.

Every rank builds the case's batch itself from (params, seed) with `equivalence.cases.batch.make_batch`
(deterministic on any device), keeps its query heads q[:, r*H:(r+1)*H], its cache and its block
table, and runs the rank body: `optimized.dcp_runtime.forward_mqa_dcp_rank` with the case's stage
overrides, or a whole replacement (`--impl MODULE:CALLABLE`, the same keywords). Outputs are
poisoned first, as in `equivalence.sandbox.calls`; tensors come back serialized over a pipe.

A group serves case after case. A case fails, and the whole group is killed, when any rank
raises (its peers are left blocked in a collective), dies, or does not answer by the deadline;
the next case starts a fresh group. The process group's own timeout is the same deadline, so a
rank blocked in a collective errors out by itself even if the parent is gone.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing.connection
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any, NoReturn, Sequence

import torch
import torch.distributed as dist

from ..cases.batch import make_batch
from ..cases.params import DcpParams
from ..judge.rows import Row
from ..sandbox.device import device_type

RANK_TENSORS = ("out", "lse", "partial_out", "partial_lse")
# NVLink multicast stays off in every rank: on the lent GPU machines a program using it can take
# the host's shared GPUs out of service, so they require these set in every process.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_TIMEOUT_S = 300.0
STARTUP_TIMEOUT_S = 120.0  # imports, CUDA context and rendezvous of one rank


class RankFailure(RuntimeError):
    """A case's ranks raised, died or hung; the message says which and how."""


class Said(StrEnum):
    """What a rank's message is (its first element), and what the parent reads where none came."""

    READY = "ready"  # the rank joined its group and imported the kernels
    OK = "ok"        # a case's tensors (serialized)
    ERROR = "error"  # the case raised (its traceback)
    DIED = "died"    # the parent's reading: the rank's process ended


@dataclass(frozen=True)
class Placement:
    backend: str               # gloo | nccl
    devices: tuple[str, ...]   # rank r computes on devices[r]

    def describe(self) -> str:
        where = ", ".join(sorted(set(self.devices)))
        return f"{len(self.devices)} ranks on {where} over {self.backend}"


def placement(world_size: int, device: str) -> Placement:
    """Backend and devices for `world_size` ranks on "cpu" or "cuda" (module docstring)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if device == "cpu":
        return Placement("gloo", ("cpu",) * world_size)
    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise RuntimeError("device cuda asked for, but no CUDA GPU is visible")
    backend = "nccl" if gpus >= world_size else "gloo"
    return Placement(backend, tuple(f"cuda:{r % gpus}" for r in range(world_size)))


def _loopback_interface() -> str:
    """Name of the loopback interface (IFF_LOOPBACK set), so sockets stay on 127.0.0.1."""
    for flags in sorted(Path("/sys/class/net").glob("*/flags")):
        if int(flags.read_text(), 16) & 0x8:
            return flags.parent.name
    return "lo"


def _serialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _deserialize(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _raised(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{type(exc).__name__}: {exc} (at {frame.filename}:{frame.lineno})"


# ----------------------------------------------------------------------------- one rank process


def _rank_case(rank: int, device: str, params: DcpParams, seed: int, specs: tuple[str, ...], declared: tuple[str, ...],
               subjects: dict) -> dict:
    """Build the batch, run the rank body on this rank's share, return plain CPU tensors."""
    # Imported here, not at the top: Triton must see TRITON_INTERPRET, set by `_rank_main`, first.
    from mla_verify.optimized import registry
    from mla_verify.optimized.buffers import poisoned
    from mla_verify.optimized.dcp_runtime import forward_mqa_dcp_rank, rank_stages
    from mla_verify.optimized.pipeline import MQAMetadata

    from ..sandbox.call_guards import guarded
    from ..spec import op_of
    from ..subject import pipeline_subject

    kind = device_type(device)
    if (specs, declared) not in subjects:
        subjects[specs, declared] = pipeline_subject("dcp", specs, kind, declared)
    subject = subjects[specs, declared]
    batch = make_batch(params, seed, device)
    heads = params.heads
    q, kv_cache, table = batch.q[:, rank * heads : (rank + 1) * heads].contiguous(), batch.rank_caches[rank], \
        batch.rank_block_tables[rank]
    stages, deviations, notes = (), (), ()
    with poisoned():
        if subject.fn is not None:  # the contract's keywords
            result = subject.fn(group=dist.group.WORLD, q=q, kv_cache=kv_cache, combine=params.combine,
                                **dict(batch.forward_kwargs(), block_table=table))
            deviations = subject.deviations
        else:
            resolved = guarded(registry.resolve(  # each stage's outputs owned before its next call
                rank_stages(params.cache_dtype, heads, dist.get_world_size(), params.combine), kind,
                subject.overrides,
            ), op_of)
            metadata = batch.metadata(MQAMetadata, block_table=table)
            result = forward_mqa_dcp_rank(q, kv_cache, batch.topk_indices, metadata, group=dist.group.WORLD,
                                          combine=params.combine, stages=resolved)
            stages = resolved.pairs()
            deviations = tuple(sorted({d for impl in resolved.chosen.values() for d in impl.deviations}))
            notes = tuple(f"{stage}: {why}" for stage, why in sorted(resolved.fallbacks.items()))
    if kind == "cuda":
        torch.cuda.synchronize()
    # A replacement may return (out, lse) only: the partials are then not compared.
    tensors = {name: t.detach().cpu() for name, t in zip(RANK_TENSORS, result)}
    return {"tensors": tensors, "stages": stages, "deviations": deviations, "notes": notes}


def _rank_main(rank: int, world_size: int, place: Placement, store_path: str, timeout_s: float, conn) -> None:
    """Entry point of rank `rank`: join the group, then serve cases until told to stop."""
    device = place.devices[rank]
    loopback = _loopback_interface()
    os.environ.update(GLOO_SOCKET_IFNAME=loopback, NCCL_SOCKET_IFNAME=loopback, **NO_MULTICAST)
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # The ranks share the machine's cores; more threads each would only contend.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(place.backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    import mla_verify.optimized  # noqa: F401  (Triton's setup and every registration, before the first case)

    conn.send((Said.READY, None))
    subjects: dict = {}
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            params, seed, specs, declared = msg
            try:
                conn.send((Said.OK, _serialize(_rank_case(rank, device, params, seed, tuple(specs), tuple(declared),
                                                       subjects))))
            except Exception as exc:  # the case's failure; the parent kills the group
                conn.send((Said.ERROR, _raised(exc)))
    except (EOFError, OSError):
        pass  # the parent is gone
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- the parent's side


@dataclass
class RankGroup:
    """`world_size` rank processes for `device` ("cpu" or "cuda"), started on first use."""

    world_size: int
    device: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    place: Placement = field(init=False)
    restarts: int = 0
    _procs: list = field(default_factory=list, init=False, repr=False)
    _conns: list = field(default_factory=list, init=False, repr=False)
    _store_dir: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.place = placement(self.world_size, self.device)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _start(self) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self._store_dir = tempfile.mkdtemp(prefix="mla-verify-dcp-")
        store_path = os.path.join(self._store_dir, "store")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, daemon=True, name=f"dcp-rank{rank}",
                               args=(rank, self.world_size, self.place, store_path, self.timeout_s, child))
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect("start", STARTUP_TIMEOUT_S)

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        """One message from every rank, or kill the group and raise RankFailure."""
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        by_waitable = {c: r for r, c in enumerate(self._conns)} | {p.sentinel: r for r, p in enumerate(self._procs)}
        while len(answers) < self.world_size:
            pending = [w for w, r in by_waitable.items() if r not in answers]
            ready = multiprocessing.connection.wait(pending, max(0.0, deadline - time.monotonic()))
            if not ready:
                missing = sorted(set(range(self.world_size)) - set(answers))
                self._fail(f"hung: rank(s) {missing} gave no answer to the {what} within {timeout_s:g} s "
                           f"({self.place.describe()})")
            for w in ready:
                rank = by_waitable[w]
                if rank in answers:
                    continue
                try:
                    kind, payload = self._conns[rank].recv() if w is self._conns[rank] else (Said.DIED, None)
                except (EOFError, OSError):
                    kind, payload = Said.DIED, None
                if kind == Said.ERROR:
                    self._fail(f"rank {rank} raised {payload}")
                if kind == Said.DIED:
                    self._procs[rank].join(5)
                    self._fail(f"rank {rank} died (exit code {self._procs[rank].exitcode}) during the {what}")
                answers[rank] = payload
        return [answers[r] for r in range(self.world_size)]

    def _fail(self, message: str) -> NoReturn:
        self.kill()
        self.restarts += 1
        raise RankFailure(message)

    def run(self, params: DcpParams, seed: int, specs: Sequence[str] = (), deviations: Sequence[str] = ()) -> list[dict]:
        """Every rank's answer for the case (params, seed) from the implementation `specs` name
        (with the declared `deviations`): {"tensors", "stages", "deviations", "notes"}, in rank
        order. Raises RankFailure (and kills the group) on any rank's failure."""
        if params.dcp_size != self.world_size:
            raise ValueError(f"a case with dcp_size {params.dcp_size} on a group of {self.world_size} ranks")
        if not self.alive:
            self.kill()
            self._start()
        for conn in self._conns:
            conn.send((params, seed, list(specs), list(deviations)))
        return [_deserialize(payload) for payload in self._collect("case", self.timeout_s)]

    def kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(10)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None

    def close(self) -> None:
        """Ask the ranks to leave the group; kill what does not exit in time."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(10)
        self.kill()


# Groups live across cases (starting one costs seconds); keyed by (world size, device, timeout).
_GROUPS: dict[tuple[int, str, float], RankGroup] = {}
_timeout_s = DEFAULT_TIMEOUT_S


def set_timeout(seconds: float) -> None:
    """Deadline of one case (and the process group's collective timeout) for groups started later."""
    global _timeout_s
    _timeout_s = float(seconds)


def group_for(world_size: int, device: str) -> RankGroup:
    key = (world_size, device, _timeout_s)
    if key not in _GROUPS:
        _GROUPS[key] = RankGroup(world_size, device, _timeout_s)
    return _GROUPS[key]


def close_all() -> None:
    while _GROUPS:
        _GROUPS.popitem()[1].close()


atexit.register(close_all)


def worst_by_rank(rows: Sequence[Row]) -> list[str]:
    """Per rank and compared tensor: the row with the least headroom, one text line per rank."""
    worst: dict[tuple[int, str], Row] = {}
    for r in rows:
        if r.rank is None or not r.gate_metric:
            continue
        key = (r.rank, r.tensor)
        if key not in worst or r.headroom < worst[key].headroom:
            worst[key] = r
    lines = []
    for rank in sorted({k[0] for k in worst}):
        cells = [f"{name} {w.gate_metric} {w.value:.3g}/{w.bound:.3g}{'' if w.passed else ' FAIL'}"
                 for name in RANK_TENSORS if (w := worst.get((rank, f"{name}_rank{rank}"))) is not None]
        lines.append(f"rank {rank}: " + " | ".join(cells))
    return lines
