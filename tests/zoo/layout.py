"""Broken shape-and-copy stages."""

import torch

from mla_verify.optimized import buffers


def contiguous_read(ql_nope, q_pe):
    """Reads the strided views as if they were contiguous (the wrong elements)."""
    flat_nope = torch.as_strided(ql_nope, ql_nope.shape, ql_nope.contiguous().stride())
    flat_pe = torch.as_strided(q_pe, q_pe.shape, q_pe.contiguous().stride())
    return torch.cat([flat_nope, flat_pe], dim=-1)


def chunks_strictly_below(seq_lens, workspace_size):
    """Greedy chunking with < instead of <=: a chunk that would exactly fill the workspace is split."""
    chunks, start, total = [], 0, 0
    for i, n in enumerate(seq_lens):
        if total + n >= workspace_size and i > start:
            chunks.append((start, i))
            start, total = i, 0
        total += n
    chunks.append((start, len(seq_lens)))
    return chunks


def sequence_major_reshape(q, num_decodes):
    """[B*s] rows read as s-major: request b's tokens taken from rows b, b+B, ..."""
    s = q.shape[0] // num_decodes
    return q.view(s, num_decodes, *q.shape[1:]).transpose(0, 1)


def writes_past_the_end(ql_nope, q_pe):
    """The concatenated q written right, then one element past its end: a tail loop's missing mask,
    allocated as the project's kernels allocate (`optimized.buffers`, red-zoned under the harness)."""
    q = buffers.empty((*ql_nope.shape[:2], 576), torch.bfloat16, ql_nope.device)
    q[..., :512], q[..., 512:] = ql_nope, q_pe
    torch.as_strided(q, (1,), (1,), q.storage_offset() + q.numel()).fill_(1.0)
    return q
