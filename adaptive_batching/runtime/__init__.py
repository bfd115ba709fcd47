"""The process and device the run lives in: ranks and collectives, memory statistics."""
