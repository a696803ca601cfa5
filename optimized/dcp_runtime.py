"""Decode context parallelism for real: one rank's part of the protocol over torch.distributed.

Each of the N ranks holds its own query heads q_r [T, H, 576], its shard of the KV (its cache and
block table) and the batch's metadata. Rank r, as vLLM's MLA layer runs it (spec §2.1 steps 5-7,
§7.4, §8):

  1. all-gather the query heads: q [T, N*H, 576], rank n's heads at [n*H, (n+1)*H);
  2. forward_mqa's mixed FP8 path over its shard (`pipeline.forward_mqa` with dcp_rank = r): the
     partial (out_r [T, N*H, 512] bf16, lse_r [T, N*H] f32), rows it owns none of the selected
     tokens of neutralized to (0, -inf);
  3. mask the rows of no request to lse -inf (`mask_empty_shards`: padding rows, seq_len 0);
  4. combine, one of the backend's two:
     ag_rs  (`cp_lse_ag_out_rs`) all-gather the LSEs [N, T, N*H]; the `dcp_lse_correct` stage
            turns out_r into bf16(f_r * out_r); reduce-scatter over heads: rank r receives
            sum_n bf16(f_n * out_n) over heads [r*H, (r+1)*H), added in bf16 by the collective,
            and keeps the same slice of the merged LSE;
     a2a    (`dcp_a2a_lse_reduce`) pack [N, T, H, 512 + 2] bf16: slot n holds heads
            [n*H, (n+1)*H) of the partial, its fp32 LSE bit-split over the last two bf16 lanes
            (low half first); all_to_all; the `dcp_a2a_merge` stage merges the N partials of this
            rank's heads in fp32 and rounds once.

`forward_mqa_dcp_rank` returns this rank's heads (out [T, H, 512] bf16, lse [T, H] f32) and the
partial of step 2, which the harness checks too: the merge turns an un-neutralized +inf LSE into
a zero weight, so only the partial shows a missing neutralization.

`Collectives` holds the three collectives in rank order. With gloo (a CPU collective backend) and
CUDA tensors, they stage through host memory; the reduce-scatter still adds in bf16.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
import torch.distributed as dist

from .metadata import mask_empty_shards
from .pipeline import MQAMetadata, forward_mqa, needed_stages
from .registry import Resolved, resolve
from .validation import check_choice, check_tensor

QK_DIM = 576
LSE_LANES = 2  # bf16 lanes one fp32 LSE is bit-split over in the all-to-all payload


class RankResult(NamedTuple):
    out: torch.Tensor          # [T, H, 512] bf16: this rank's heads of the combined output
    lse: torch.Tensor          # [T, H] f32: their merged LSE
    partial_out: torch.Tensor  # [T, N*H, 512] bf16: forward_mqa over this rank's shard
    partial_lse: torch.Tensor  # [T, N*H] f32: its LSE, neutralized, before the padding mask


class Collectives:
    """all_gather / reduce_scatter / all_to_all over one process group, slot n <-> rank n."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        # gloo moves host memory only: CUDA tensors travel through a host copy.
        self._host_wire = dist.get_backend(group) == "gloo"

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        return (t.cpu() if self._host_wire else t).contiguous()

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `t` concatenated along `dim` in rank order."""
        wire = self._wire(t)
        parts = [torch.empty_like(wire) for _ in range(self.size)]
        dist.all_gather(parts, wire, group=self.group)
        return torch.cat(parts, dim=dim).to(t.device)

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """sum_n (rank n's t).chunk(N, dim)[this rank], added in t's dtype by the collective."""
        chunks = [c.contiguous() for c in self._wire(t).chunk(self.size, dim)]
        out = torch.empty_like(chunks[self.rank])
        dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=self.group)
        return out.to(t.device)

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """t [N, ...]: slot n goes to rank n; the result's slot n came from rank n."""
        wire = self._wire(t)
        out = torch.empty_like(wire)
        dist.all_to_all_single(out, wire, group=self.group)
        return out.to(t.device)


def pack_a2a(out: torch.Tensor, lse: torch.Tensor, size: int) -> torch.Tensor:
    """out [T, N*H, D] bf16, lse [T, N*H] f32 -> [N, T, H, D + 2] bf16: slot n holds heads
    [n*H, (n+1)*H) with each LSE's 32 bits in the last two lanes, low half first. Assembled as
    int16 so that no lane is ever converted (a NaN-patterned half must keep its bits)."""
    tokens, heads, dim = out.shape
    halves = lse.float().contiguous().unsqueeze(-1).view(torch.int16)  # [T, N*H, 2], little-endian
    packed = torch.cat([out.contiguous().view(torch.int16), halves], dim=-1).view(torch.bfloat16)
    return packed.view(tokens, size, heads // size, dim + LSE_LANES).transpose(0, 1).contiguous()


def unpack_a2a(received: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, T, H, D + 2] bf16 -> (outs [N, T, H, D] bf16, lses [N, T, H] f32): `pack_a2a` undone."""
    dim = received.shape[-1] - LSE_LANES
    lses = received[..., dim:].contiguous().view(torch.int16).view(torch.float32).squeeze(-1)
    return received[..., :dim], lses


def _combine_ag_rs(comm: Collectives, out: torch.Tensor, lse: torch.Tensor, stages: Resolved):
    lses = comm.all_gather(lse.unsqueeze(0), dim=0)
    scaled, merged = stages.fn("dcp_lse_correct")(out_r=out, lses=lses, rank=comm.rank)
    heads = out.shape[1] // comm.size
    return comm.reduce_scatter(scaled, dim=1), merged[:, comm.rank * heads : (comm.rank + 1) * heads]


def _combine_a2a(comm: Collectives, out: torch.Tensor, lse: torch.Tensor, stages: Resolved):
    outs, lses = unpack_a2a(comm.all_to_all(pack_a2a(out, lse, comm.size)))
    return stages.fn("dcp_a2a_merge")(outs=outs, lses=lses)


# combine -> (the registry stage it merges with, the exchange around it)
COMBINES = {"ag_rs": ("dcp_lse_correct", _combine_ag_rs), "a2a": ("dcp_a2a_merge", _combine_a2a)}


def rank_stages(kv_cache_dtype: str, num_heads: int, dcp_size: int, combine: str) -> list[str]:
    """The stages one rank uses: forward_mqa's on its shard, then its combine's."""
    check_choice("combine", combine, tuple(COMBINES))
    forward = [s for s in needed_stages(kv_cache_dtype, num_heads, dcp_size) if s != "dcp_merge"]
    return forward + [COMBINES[combine][0]]


def forward_mqa_dcp_rank(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_indices: torch.Tensor,
    metadata: MQAMetadata,
    *,
    group: dist.ProcessGroup | None,
    combine: str = "ag_rs",
    stages: Resolved | None = None,
) -> RankResult:
    """This rank's DCP forward_mqa (module docstring): q [T, H, 576] bf16 its own heads, kv_cache
    and metadata.block_table its shard, the rest of the metadata the whole batch's (global
    seq_lens; the top-k global positions); dcp_size and dcp_rank are the group's. Collective:
    every rank of `group` calls it with the same batch metadata."""
    m = metadata
    check_choice("combine", combine, tuple(COMBINES))
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, m.num_heads, QK_DIM))
    comm = Collectives(group)
    if stages is None:
        stages = resolve(rank_stages(m.kv_cache_dtype, m.num_heads, comm.size, combine), q.device.type)
    gathered = comm.all_gather(q, dim=1)
    part = forward_mqa(gathered, kv_cache, topk_indices, replace(m, dcp_size=comm.size, dcp_rank=comm.rank), stages)
    masked = mask_empty_shards(part.lse, m.seq_lens, m.query_start_loc)
    out, lse = COMBINES[combine][1](comm, part.out, masked, stages)
    return RankResult(out, lse, part.out, part.lse)
