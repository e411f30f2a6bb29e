"""CONA: train language models under a chain of parallel strategies."""

__version__ = "0.1.0"
