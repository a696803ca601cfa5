"""What a case is and how its inputs are drawn and built: the schema of each spec's params, the
Hypothesis draws, value regimes, invalid-index patterns, layouts, builders of the batches, profiles
and the interpreter's cost estimate (Hypothesis's strategies, for this harness)."""
