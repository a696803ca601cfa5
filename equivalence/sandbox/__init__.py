"""Running the user's kernel where it cannot reach the judge: the worker process and its wire, the
shared segments, the guards around a call and the reaper of what the kernel started."""
