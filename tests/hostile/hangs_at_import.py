"""A kernel module that never finishes importing in a worker (issue 45, item 6): a usage error
once the import has had its time, never the harness's 1800 s limit."""

import os
import time

if "MLA_VERIFY_WORKER_TREE" in os.environ:
    time.sleep(3600)


def quantize(kv, scale_rule="pow2"):
    raise AssertionError("never called")
