"""Whether a process exists on this host, as `cona status` and a waiting session worker ask it."""

from __future__ import annotations

import os


def signal_reaches(pid: int) -> bool:
    """Whether signal 0 reaches ``pid``: the process exists (maybe as a zombie, maybe another user's)."""
    if pid <= 0:
        return False  # signal 0 to pid 0 or -1 would test a whole process group
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    return True
