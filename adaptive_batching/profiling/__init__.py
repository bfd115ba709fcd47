"""The start-up profiler: the memory budget, trial steps, the fit, the verification search, the cache and the
report."""
