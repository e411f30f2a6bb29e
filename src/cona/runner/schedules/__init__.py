"""What decides the next stage: a chain file, or the online policy beside the training."""
