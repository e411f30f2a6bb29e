"""Runs across several nodes: placement, the runners' store and barriers, the coordinated launch."""
