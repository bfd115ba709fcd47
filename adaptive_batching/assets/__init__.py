"""Offline tiny models, tokenizers and data: what the tests, the demo and the validation train on."""
