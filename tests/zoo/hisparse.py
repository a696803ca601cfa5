"""Broken HiSparse data-plane stages and index groups (spec hisparse.md §6), each the project's
stage with one defect, swapped into the HiSparse pipeline as a stage override."""

import torch

from mla_verify.optimized import hisparse, registry
from mla_verify.optimized.index_group import IndexGroup


def skips_missing_copy(host_rows, gpu_rows, src, dst):
    """The swap list's first missing row is listed but not copied: its hot slot keeps stale bytes."""
    return hisparse.hisparse_swap_in(host_rows, gpu_rows, src[1:], dst[1:])


def counts_off_by_one(req_id, host_rows, resident_rows, tables, block_size, return_valid_counts):
    """Valid counts one short: the last valid row of every non-empty row is dropped."""
    phys, counts, src, dst = hisparse.hisparse_place(req_id, host_rows, resident_rows, tables, block_size,
                                                     return_valid_counts)
    return phys, (counts - 1).clamp(min=0), src, dst


def req_ids_not_rebased(host_rows, gpu_rows, host_row_ids, device_row_ids, req_id_per_token, num_decodes,
                        num_decode_tokens):
    """Prefill req ids handed back batch-relative: the staged table's rows are num_decodes off."""
    staged, _ = hisparse.stage_prefill_rows(host_rows, gpu_rows, host_row_ids, device_row_ids, req_id_per_token,
                                            num_decodes, num_decode_tokens)
    return staged, req_id_per_token[num_decode_tokens:].clone()


def request_start_ignored(staged_rows, block_table, workspace_starts, batch_size, request_start, num_rows, block_size):
    """Every chunk gathered through the first chunk's block-table rows (request_start taken as 0)."""
    fn = registry.select("gather_fp8_prefill", staged_rows.device.type, "torch-fp32").fn
    return fn(staged_rows, block_table, workspace_starts, batch_size, 0, num_rows, block_size)


class _StaleFollowers(IndexGroup):
    def convert_once(self, layer, convert, return_valid_counts, **kwargs):
        n = kwargs["topk_indices"].shape[0]
        if layer == 0 or n > self.physical.shape[0]:
            return convert(return_valid_counts=return_valid_counts, **kwargs)
        return (self.physical[:n], self.counts[:n]) if return_valid_counts else self.physical[:n]


def followers_read_stale_buffer(physical, counts):
    """Layer 0 converts into fresh tensors, not the persistent buffer: later layers read the previous step's rows."""
    return _StaleFollowers(physical, counts)


class _NoFallback(IndexGroup):
    def convert_once(self, layer, convert, return_valid_counts, **kwargs):
        n = kwargs["topk_indices"].shape[0]
        if n <= self.physical.shape[0]:
            return super().convert_once(layer, convert, return_valid_counts, **kwargs)
        # The buffer overrun: only the rows that fit are kept, the rest of the batch is never converted.
        res = convert(return_valid_counts=return_valid_counts, **kwargs)
        idx = res[0] if return_valid_counts else res
        rows = self.physical.shape[0]
        self.physical.copy_(idx[:rows])
        if return_valid_counts:
            self.counts.copy_(res[1][:rows])
        tail = torch.full_like(idx[rows:], -1)
        out = torch.cat([self.physical, tail])
        return (out, torch.cat([self.counts, torch.zeros_like(res[1][rows:])])) if return_valid_counts else out


def fallback_not_taken(physical, counts):
    """A batch larger than the persistent buffer converted into it anyway: rows past it are lost."""
    return _NoFallback(physical, counts)
