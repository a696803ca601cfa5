"""One tensor against the reference: the metrics, the per-element bounds, the tolerance policy and
the conventions, the verdict and its words, the row that records it."""
