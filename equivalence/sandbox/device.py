"""What a CUDA error leaves behind. A device-side assert or an illegal address is reported
asynchronously, at whatever call synchronizes next, and it poisons the whole context: every later
CUDA call in that process fails too. So after an implementation raises on CUDA the device is
synchronized (the error is the implementation's), and a process that saw a CUDA error is never
trusted with another case."""

from __future__ import annotations

import os
import re

import torch

# The fraction of its GPU a process may hold, where several campaigns share one (`--parallel` past
# the GPU count sets it for each part): torch's caching allocator gives back what it caches before
# it takes more, so a part's peak, not the sum of the others' caches, is what must fit.
GPU_SHARE_ENV = "MLA_VERIFY_GPU_SHARE"
# An isolated campaign's worker holds one case's inputs, outputs and the kernel's workspace; its
# judge a block's inputs, the reference's answers and bounds: the worker takes this part of their
# share, the judge the rest (half each ran the judges of `--parallel 4` out of memory on an H100).
WORKER_SHARE = 0.25

# Messages of the errors the CUDA runtime, driver and libraries raise through torch and Triton.
_DEVICE_ERROR = re.compile(r"CUDA error|CUDA driver error|\[CUDA\]|cudaError|device-side assert|illegal memory access"
                           r"|illegal instruction|misaligned address|unspecified launch failure|CUBLAS_STATUS"
                           r"|CUDNN_STATUS|NCCL error", re.IGNORECASE)


def device_type(device: str | object) -> str:
    """The kind a device string names: "cuda" of "cuda:1", "cpu" of "cpu" (what torch.device(d).type
    says, without building one). Every device string is read here."""
    return str(device).split(":")[0]


def is_cuda(device: str | object) -> bool:
    return device_type(device) == "cuda"


def is_device_error(error: BaseException | str) -> bool:
    """Whether an exception (or its message) is the CUDA device's rather than Python's."""
    accelerator = getattr(torch, "AcceleratorError", None)
    if accelerator is not None and isinstance(error, accelerator):
        return True
    return bool(_DEVICE_ERROR.search(str(error)))


def synchronize(device: str) -> str | None:
    """Wait for the device; the error it reports (one line), or None."""
    if not is_cuda(device):
        return None
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # any failure here is the device's
        return first_line(exc)
    return None


def usable(device: str) -> bool:
    """Whether a fresh allocation and a kernel still work on `device` (a poisoned context fails)."""
    if not is_cuda(device):
        return True
    try:
        return torch.ones(1, device=device).add_(1).item() == 2.0
    except Exception:  # a poisoned context raises on anything
        return False


def context_lost(error: BaseException, device: str) -> str | None:
    """Why a harness error met once the implementation ran is that call's crash, not the
    harness's: the call took the CUDA context with it (the error is the device's, or the device
    no longer works); None where the context stands. The one rule for the worker's process and a
    block judged in the implementation's own (`equivalence.blocks`)."""
    if is_cuda(device) and (is_device_error(error) or not usable(device)):
        return f"CUDA error after the implementation ran: {first_line(error)}"
    return None


def take_gpu_share(part: float = 1.0) -> None:
    """Hold this process to `part` of its campaign's GPU share (MLA_VERIFY_GPU_SHARE), if one is
    set: an isolated campaign's worker takes WORKER_SHARE, its judge the rest."""
    share = os.environ.get(GPU_SHARE_ENV)
    if share and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(float(share) * part)


def first_line(error: BaseException | str, limit: int = 300) -> str:
    """The first non-empty line of an error's message, at most `limit` characters."""
    text = str(error).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."
