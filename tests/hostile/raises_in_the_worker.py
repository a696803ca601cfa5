"""A kernel module that raises while imported, but only in a worker (issue 45, item 6): the judge,
which never imports it, must still end the run as a one-line usage error, never exit 3."""

import os

if "MLA_VERIFY_WORKER_TREE" in os.environ:
    raise RuntimeError("this module refuses to be imported in a worker")


def quantize(kv, scale_rule="pow2"):
    raise AssertionError("never called")
