"""The ops of the public contract and the pipelines, one module per concern; each registers its
specs (`ops.base.OpSpec`, `ops.pipeline.PipelineSpec`) with `equivalence.spec`."""
