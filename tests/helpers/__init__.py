"""What the tests share: tiny configs and runs, fakes of the workers, launch and kill utilities, and the
recorded run directory the report and status tests read (``fixtures/``)."""
