"""Misbehaving implementations that run on CPU: each computes the right answer with the float32
eager implementation (`optimized.eager`) and then breaks one promise the contract makes beyond
values. The outcome each must get is in `tests.hostile.CPU`."""

import os
import random
import secrets
import signal
import time

import numpy as np
import torch

from mla_verify.optimized import eager

_calls = {"n": 0}


def _count() -> int:
    _calls["n"] += 1
    return _calls["n"]


# ----------------------------------------------------------------------------- inputs written


def zeroes_kv(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """Right answer, then clears the KV rows it read (a kernel reusing its input as scratch)."""
    result = eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    kv.zero_()
    return result


def zeroes_q(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    result = eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    q.zero_()
    return result


def zeroes_indices(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """Compacts the index rows in place (the next layer reads the wrong top-k)."""
    result = eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    indices.zero_()
    return result


def zeroes_block_table(req_id, block_table, topk_indices, block_size, block_stride_rows=None,
                       prefill_request_ids=None, prefill_workspace_starts=None, return_valid_counts=False,
                       idx_mapping=None):
    result = eager.convert_index(req_id, block_table, topk_indices, block_size, block_stride_rows,
                                 prefill_request_ids, prefill_workspace_starts, return_valid_counts, idx_mapping)
    block_table.zero_()
    return result


def zeroes_lses(outs, lses):
    """Sanitizes the ranks' LSEs in place while merging."""
    result = eager.dcp_merge(outs, lses)
    lses.zero_()
    return result


def scribbles_kv_cache(q, kv_cache, indices, sm_scale):
    """Right answer, then overwrites one cache row: the next request reads a corrupted cache."""
    result = eager.sparse_decode_fp8(q, kv_cache, indices, sm_scale)
    kv_cache[0, 0].zero_()
    return result


def writes_cache_padding(kv, kv_cache, slot_mapping, scale_rule="pow2"):
    """Writes its slots right, and one byte of the padding between cache blocks (the storage past
    the view): only slot_mapping's slots may change."""
    eager.write_fp8_ds_mla_cache(kv, kv_cache, slot_mapping, scale_rule)
    storage = torch.empty(0, dtype=torch.uint8, device=kv_cache.device).set_(kv_cache.untyped_storage())
    storage[-1] = 0


def returns_input_view(outs, lses):
    """A one-rank fast path that hands back its input: writing the result writes the partials."""
    if outs.shape[0] == 1:
        return outs[0], lses[0]
    return eager.dcp_merge(outs, lses)


# ----------------------------------------------------------------------------- return contract


def out_float32(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    out, lse, max_logits = eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    return out.float(), lse, max_logits


def lse_float64(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    out, lse, max_logits = eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    return out, lse.double(), max_logits


def int32_out(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    out, lse, max_logits = eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    return out.to(torch.int32), lse, max_logits


def extra_output(q, kv_cache, indices, sm_scale):
    out, lse = eager.sparse_decode_fp8(q, kv_cache, indices, sm_scale)
    return out, lse, lse


def returns_list(kv, scale_rule="pow2"):
    return list(eager.quantize_fp8_ds_mla(kv, scale_rule))


def meta_out(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    out, lse, max_logits = eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    return torch.empty_like(out, device="meta"), lse, max_logits


def strided_workspace(kv_cache, block_table, workspace_starts, num_rows):
    """Right values in a column-major buffer: the prefill kernel reading it row by row gets garbage."""
    workspace = eager.gather_upconvert_fp8(kv_cache, block_table, workspace_starts, num_rows)
    return workspace.t().contiguous().t()


def padded_workspace(kv_cache, block_table, workspace_starts, num_rows):
    """Right values, each row in a wider one (a view with gaps: its host copy is contiguous, so an
    isolated judge must be told the strides it was returned with)."""
    workspace = eager.gather_upconvert_fp8(kv_cache, block_table, workspace_starts, num_rows)
    rows, width = workspace.shape
    wide = torch.zeros(rows, width + 64, dtype=workspace.dtype, device=workspace.device)
    wide[:, :width] = workspace
    return wide[:, :width]


# ----------------------------------------------------------------------------- run to run


def wrong_every_other_call(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """Flaky, deterministically: every second call scales the output (a race that loses half the time)."""
    out, lse, max_logits = eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    return (out * 2 if _count() % 2 == 0 else out), lse, max_logits


def wrong_on_a_coin_flip(kv, scale_rule="pow2"):
    """Flaky for real: the OS's entropy decides (nothing the harness seeds)."""
    rows = eager.quantize_fp8_ds_mla(kv, scale_rule)
    if secrets.randbelow(2):
        rows[:, 0] ^= 1
    return rows


def python_random(kv, scale_rule="pow2"):
    """Wrong when Python's `random` says so: seeded from the case, a replay sees the same draw."""
    rows = eager.quantize_fp8_ds_mla(kv, scale_rule)
    if random.random() < 0.5:
        rows[:, 0] ^= 1
    return rows


def numpy_random(kv, scale_rule="pow2"):
    rows = eager.quantize_fp8_ds_mla(kv, scale_rule)
    if np.random.rand() < 0.5:
        rows[:, 0] ^= 1
    return rows


# ----------------------------------------------------------------------------- ending the process


def system_exit(kv, scale_rule="pow2"):
    """`sys.exit(0)` from inside a kernel must not end the run with exit 0."""
    raise SystemExit(0)


def generator_exit(kv, scale_rule="pow2"):
    raise GeneratorExit


def aborts(kv, scale_rule="pow2"):
    os.abort()


def aborts_on_three_rows(kv, scale_rule="pow2"):
    """Takes its process down on cases of 3 rows or more (the CPU stand-in of a device-side assert
    on some shapes): the minimized case has n = 3, and correct cases in between must pass."""
    if kv.shape[0] >= 3:
        os.abort()
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


def interrupted_on_third_call(kv, scale_rule="pow2"):
    """Always wrong; the third call is interrupted by Ctrl-C (SIGINT to this process)."""
    if _count() == 3:
        os.kill(os.getpid(), signal.SIGINT)
    rows = eager.quantize_fp8_ds_mla(kv, scale_rule)
    rows[:, 0] ^= 1
    return rows


def killed_on_third_call(kv, scale_rule="pow2"):
    """Always wrong; the third call kills the whole process (SIGKILL: no handler runs)."""
    if _count() == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    rows = eager.quantize_fp8_ds_mla(kv, scale_rule)
    rows[:, 0] ^= 1
    return rows


# ----------------------------------------------------------------------------- static output buffers

_static: dict[str, torch.Tensor] = {}


def _into_static(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` copied into this kernel's persistent buffer `name` (reallocated when the shape moves),
    which every call returns: what CUDA-graph capture and workspace managers do."""
    buf = _static.get(name)
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        buf = _static[name] = torch.empty_like(t)
    return buf.copy_(t)


def static_prefill(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """Right answer, written into static buffers: a correct serving kernel (every check passes)."""
    out, lse, max_logits = eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    return _into_static("out", out), _into_static("lse", lse), max_logits


def static_prefill_racy(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """Static buffers and a race that changes the output's last bits on every other call: run to
    run nondeterministic, which `property:determinism` must see although both calls return the
    same storage."""
    out, lse, max_logits = eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    if _count() % 2 == 0:
        out = (out.float() * (1 + 2**-7)).to(out.dtype)
    return _into_static("out", out), _into_static("lse", lse), max_logits


# ----------------------------------------------------------------------------- the process and the judge


def sets_default_dtype(kv, scale_rule="pow2"):
    """Right answer, and float64 as the default dtype for everything after it."""
    torch.set_default_dtype(torch.float64)
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


def changes_directory(kv, scale_rule="pow2"):
    os.chdir("/")
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


def turns_off_grad(kv, scale_rule="pow2"):
    torch.set_grad_enabled(False)
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


def sets_threads(kv, scale_rule="pow2"):
    torch.set_num_threads(torch.get_num_threads() + 1)
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


def replaces_stdout(kv, scale_rule="pow2"):
    import io
    import sys

    sys.stdout = io.StringIO()
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


def _everything_equal(*args, **kwargs):
    return torch.zeros(())


def patches_torch_sub(kv, scale_rule="pow2"):
    """Wrong bytes, and torch.sub (and torch.Tensor.__ne__) patched so that differences vanish."""
    rows = eager.quantize_fp8_ds_mla(kv, scale_rule)
    rows[:, 0] ^= 1
    torch.sub = _everything_equal
    torch.Tensor.__ne__ = lambda a, b: torch.zeros(a.shape, dtype=torch.bool)
    return rows


def patches_the_oracle(kv, scale_rule="pow2"):
    """Wrong bytes, and the oracle's own verdict replaced by one that always passes."""
    from mla_verify.equivalence.judge import oracle

    rows = eager.quantize_fp8_ds_mla(kv, scale_rule)
    rows[:, 0] ^= 1
    real = oracle.verdict
    oracle.verdict = lambda kind, m, bounds, deviation="": real(kind, type(m)(numel=m.numel), bounds, deviation)
    return rows


class _Agreeable(torch.Tensor):
    """A tensor whose every comparison says equal."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs or {})
        if func in (torch.Tensor.__ne__, torch.ne, torch.Tensor.ne):
            return torch.zeros_like(result, dtype=torch.bool).as_subclass(torch.Tensor)
        return result


def returns_a_lying_subclass(kv, scale_rule="pow2"):
    rows = eager.quantize_fp8_ds_mla(kv, scale_rule)
    rows[:, 0] ^= 1
    return rows.as_subclass(_Agreeable)


def returns_the_reference(kv, scale_rule="pow2"):
    """Wrong, and hands back the reference's own answer instead where it finds one through the
    garbage collector (there is none: the reference answers after the block's calls, or in an
    isolated run's parent)."""
    import gc

    rows = eager.quantize_fp8_ds_mla(kv, scale_rule)
    rows[:, 0] ^= 1
    for obj in gc.get_objects():
        if (type(obj) is dict and isinstance(obj.get("rows"), torch.Tensor) and obj["rows"] is not rows
                and obj["rows"].shape == rows.shape and obj["rows"].dtype == rows.dtype):
            return obj["rows"]
    return rows


def writes_the_reference(kv, scale_rule="pow2"):
    """Wrong bytes, copied over the reference's answer where it finds one through the garbage
    collector (none: as `returns_the_reference`)."""
    import gc

    rows = eager.quantize_fp8_ds_mla(kv, scale_rule)
    rows[:, 0] ^= 1
    for obj in gc.get_objects():
        if type(obj) is dict and isinstance(obj.get("rows"), torch.Tensor) and obj["rows"] is not rows \
                and obj["rows"].shape == rows.shape:
            obj["rows"].copy_(rows)
    return rows


def raises_keyboard_interrupt(kv, scale_rule="pow2"):
    """A KeyboardInterrupt of its own (no Ctrl-C): the kernel's failure, not the user's stop."""
    raise KeyboardInterrupt


# ----------------------------------------------------------------------------- odd outputs


def sparse_out(kv, scale_rule="pow2"):
    return eager.quantize_fp8_ds_mla(kv, scale_rule).to_sparse()


def mkldnn_out(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    out, lse, max_logits = eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    return out, lse.to_mkldnn(), max_logits


def sleeps(kv, scale_rule="pow2"):
    import time

    time.sleep(6)
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


# ----------------------------------------------------------------------------- the process ends mid-run


def exits_on_third_call(kv, scale_rule="pow2"):
    """Correct, until the third call ends the process at once (os._exit(0): no handler, no flush)."""
    if _count() == 3:
        os._exit(0)
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


def segfaults_on_third_call(kv, scale_rule="pow2"):
    if _count() == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


def sigterm_on_third_call(kv, scale_rule="pow2"):
    """Correct; the third call receives SIGTERM (as from a CI runner's cancel): handled as Ctrl-C."""
    if _count() == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


def prefill_sigterm_once_on_third_call(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """Correct; the third call receives SIGTERM the first time it runs in this working directory (a
    file marks it), so that a run of the rest afterwards goes through."""
    if _count() == 3 and not os.path.exists("interrupted-once"):
        open("interrupted-once", "w").close()
        os.kill(os.getpid(), signal.SIGTERM)
    return eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)


def says_each_call(kv, scale_rule="pow2"):
    """Correct and a little slow; says "call N" on the output it inherited (the run's), so that a
    test can signal the run's process group while cases are running, as `timeout`, Slurm's
    scancel or a Kubernetes pod's deletion do."""
    os.write(1, f"call {_count()}\n".encode())
    time.sleep(0.1)
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


def loosens_the_bounds(kv, scale_rule="pow2"):
    """Wrong bytes, and the exact bound itself loosened in place (a mutation, not a rebinding: no
    check of names sees it). Only a judge in another process is out of its reach."""
    from mla_verify.equivalence.judge import policy

    rows = eager.quantize_fp8_ds_mla(kv, scale_rule)
    rows[:, 0] ^= 1
    object.__setattr__(policy.EXACT_BOUNDS[0], "limit", 1.0)
    return rows


def sets_default_device(kv, scale_rule="pow2"):
    torch.set_default_device("meta")
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


# ----------------------------------------------------------------------------- declining (issue 45, item 5)


def declines_every_case(kv, scale_rule="pow2"):
    """Declines whatever it is asked: a run of it judged nothing, which is no pass."""
    from mla_verify import unsupported

    unsupported("this kernel takes no input at all")


def declines_by_value(kv, scale_rule="pow2"):
    """Declines the cases whose first value is positive (about half of them, whatever their
    shapes), where it would be wrong, and answers the rest right: a decline that depends on the
    values, not the params, hides the wrong answers as "not checked"."""
    from mla_verify import unsupported

    if float(kv.reshape(-1)[0]) > 0:
        unsupported("a positive first value")
    return eager.quantize_fp8_ds_mla(kv, scale_rule)
