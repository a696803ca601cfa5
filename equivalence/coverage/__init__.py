"""Which cases a campaign starts with: every op's (and forward_mqa path's) covering features, read
from the built tensors, and the covering sets that together hit each of them."""
