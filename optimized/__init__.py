"""The side under test: the backend's GPU implementation, as named, replaceable stages.

Importing this package registers every implementation in order of preference (the registry
lists earlier registrations first): the real FlashMLA kernels, then our Triton kernels.
"""

from optimized.kernels import cache_writer, concat, dcp_merge, gather, indices  # noqa: F401
