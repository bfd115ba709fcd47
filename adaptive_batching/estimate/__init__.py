"""The offline estimate: the largest micro batch for a device you do not have, from fake-tensor steps (a traced
or compiled layer extrapolated, the memory savers, the optimizer's state), with the start-up profiler's fit and
search; only the ``adaptive-batching estimate`` command uses it."""
