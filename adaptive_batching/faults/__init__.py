"""What keeps a run alive or resumable: out-of-memory classification, the step guard, OOM recovery,
torchrun restarts and kill-safe checkpoints."""
