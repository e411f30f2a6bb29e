"""The time-to-target benchmark (``bench/time_to_target.py``): presets and run plans (:mod:`.plan`), running
and stopping one run (:mod:`.supervise`), reading the runs back (:mod:`.report`) and the hindsight bound of
any chain on the same runs (:mod:`.headroom`)."""
