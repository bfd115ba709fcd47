"""Config files and keys: resolving ``--config``, the known top-level keys, and validating every
adaptive key before any model loads."""
