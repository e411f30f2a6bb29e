"""What a person reads: the console, cona status, cona report, the trackers."""
