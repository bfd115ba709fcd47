"""The trainer and what it composes: components, the model and fine-tuning method, the step runner,
run state and checkpoints."""
