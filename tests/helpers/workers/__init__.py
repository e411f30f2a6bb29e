"""Scripts the tests start as training workers under torchrun (each also importable for its constants)."""
