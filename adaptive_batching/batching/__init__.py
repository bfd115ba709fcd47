"""How a step's samples are chosen: the batch shape, the sample-count and token-budget policies, their
samplers, the per-epoch plan, elastic global batches and the plan's guard rails."""
