"""The start-up profiler (budget, trial steps, fit, verification search, cache, report) and ``estimate``,
which predicts the same answer for a device you do not have."""
