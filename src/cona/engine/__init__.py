"""The training engine: GPT, parallel layouts, the training step, optimizer, checkpoints, the worker."""
