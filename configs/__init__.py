"""Configs shipped with adaptive-batching, found by name by the recipes."""
