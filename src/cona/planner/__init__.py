"""The planner: system descriptions, an analytical iteration-time and memory model, calibration from measured
step times, and (built on them) the strategy space and its search.

Pure functions on frozen data; the engine never imports it, the runner and the CLI do.
"""
