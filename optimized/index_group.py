"""The index group: layers that consume one indexer result convert it once (vLLM 0.33
`SparseMLAIndexGroup` / `HiSparseMLAIndexGroup`, spec hisparse.md §2).

Plain conversion (`convert_once`): layer 0 converts on the side stream into the group's
persistent buffers (`physical [max_rows + 1, K]`, `counts [max_rows + 1]`) and records
`physical_topk_ready`; every layer (0 included) makes the compute stream wait on it and reads the
buffers. A batch of more tokens than the buffers hold falls back to a fresh conversion on the
compute stream, at every layer.

HiSparse swap-in (`swap_in`): the leader (layer 0) converts the top-k to host rows and to
resident rows (the residency table through `idx_mapping`), places the missing rows in hot slots
(`hisparse_place`) on the copy stream, once for the group; every layer then copies the shared
swap list from its own host cache into its own slab (`hisparse_swap_in`) on the copy stream and
records its own event, which the compute stream waits for before that layer's kernel.

On CPU there are no streams: the same calls run in program order.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .registry import register


class Streams:
    """The side, copy and prefill streams of the group on CUDA; nothing on CPU."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if cuda else None
        self.prefill = torch.cuda.Stream(device) if cuda else None

    @contextlib.contextmanager
    def on(self, stream) -> Iterator[None]:
        """Run the block on `stream` after the work queued so far on the compute stream."""
        if stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            yield

    @staticmethod
    def record(stream):
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def wait(event, *tensors: torch.Tensor) -> None:
        """The compute stream waits for `event`; tensors made on the side stream are marked used here."""
        if event is None:
            return
        torch.cuda.current_stream().wait_event(event)
        for t in tensors:
            t.record_stream(torch.cuda.current_stream())


@dataclass
class SwapIn:
    """One step's swap-in, shared by the group's layers."""

    physical: torch.Tensor  # [N, K] int32 slab rows
    counts: torch.Tensor    # [N] int32
    src: torch.Tensor       # [n] int64 host rows to copy ...
    dst: torch.Tensor       # [n] int64 ... into these slab rows


class IndexGroup:
    """One indexer result shared by L layers (module docstring). `physical` / `counts` are the
    persistent buffers as a previous step left them."""

    def __init__(self, physical: torch.Tensor, counts: torch.Tensor):
        self.physical, self.counts = physical.clone(), counts.clone()
        self.streams = Streams(physical.device)
        self._ready = None                       # physical_topk_ready
        self._resolved: SwapIn | None = None   # the leader's swap-in of this step

    def convert_once(self, layer: int, convert: Callable, return_valid_counts: bool, **kwargs):
        """`_convert_once`: the converter's result for this step, converted by layer 0 only."""
        n = kwargs["topk_indices"].shape[0]
        if n > self.physical.shape[0]:
            return convert(return_valid_counts=return_valid_counts, **kwargs)
        if layer == 0:
            with self.streams.on(self.streams.side):
                res = convert(return_valid_counts=return_valid_counts, **kwargs)
                idx = res[0] if return_valid_counts else res
                self.physical[:n].copy_(idx)
                if return_valid_counts:
                    self.counts[:n].copy_(res[1])
                self._ready = self.streams.record(self.streams.side)
        self.streams.wait(self._ready)
        return (self.physical[:n], self.counts[:n]) if return_valid_counts else self.physical[:n]

    def swap_in(self, layer: int, resolve: Callable[[], SwapIn], copy: Callable, host_rows: torch.Tensor,
                gpu_rows: torch.Tensor) -> tuple[SwapIn, torch.Tensor]:
        """This layer's hot slab after the step's swaps (resolved by the leader once) and the shared result."""
        if layer == 0:
            with self.streams.on(self.streams.side):
                self._resolved = resolve()
        with self.streams.on(self.streams.side):
            hot = copy(host_rows=host_rows, gpu_rows=gpu_rows, src=self._resolved.src, dst=self._resolved.dst)
            ready = self.streams.record(self.streams.side)
        self.streams.wait(ready, hot, self._resolved.physical, self._resolved.counts)
        return self._resolved, hot


@register("index_group", "torch-fp32")
def index_group(physical: torch.Tensor, counts: torch.Tensor) -> IndexGroup:
    """SparseMLAIndexGroup / HiSparseMLAIndexGroup: convert once per group, layer 0 on the side stream."""
    return IndexGroup(physical, counts)
