"""Implementations that take the harness's process down, for the crash-isolation tests."""

import os
import signal
import time


def segfaults(kv, scale_rule="pow2"):
    """Dies the way a CUDA illegal address does: the process, not an exception."""
    os.kill(os.getpid(), signal.SIGSEGV)


def exits(kv, scale_rule="pow2"):
    os._exit(3)


def hangs(kv, scale_rule="pow2"):
    time.sleep(3600)


def wrong_signature(kv):
    """Misses the contract's `scale_rule` keyword."""
    return kv
