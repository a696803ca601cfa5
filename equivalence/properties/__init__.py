"""Metamorphic and determinism properties: checks that need no reference.

A property poses one problem two ways that agree in exact arithmetic (a top-k set and the LSE
merge of its parts, a decode batch and its requests one at a time, a run and its rerun, ...) and
holds an implementation's two answers to each other. At production shapes the float64 reference
is the bottleneck, and some bugs (batch dependence, nondeterminism, a wrong LSE that a single
call never shows) appear only as inconsistency. One, `cuda_graph`, holds a kernel's CUDA-graph
replays to its eager calls and, since a replay is a serving call, also to the reference.

A property case is a Case with op "property:NAME" and params {"target": TARGET, ...}: the target
is what runs (a stage such as "sparse_decode_fp8", or "forward_mqa", the pipeline), the rest its
base problem (the op's own params, see equivalence.ops) and the property's knobs. Its rows have
op "property", path NAME and tensor "CHECK.TENSOR" (e.g. "wider_k.out"); each check's bound is
`equivalence.judge.policy.PROPERTY_RULES["NAME.CHECK"]`: exact where the kernels promise identical bits,
a rounding bound elsewhere, and a declared deviation's bound where a kernel documents why not.
"""
