"""Settings every test process shares."""

from __future__ import annotations

import os

# One intra-op thread in the pytest process (read by torch when it is first imported, which is after this
# file): the tests' models are tiny, where a second thread gains nothing, and on a machine whose cores other
# processes keep busy two threads per op spin against each other (a tiny GPT's step took 35x longer).
os.environ.setdefault("OMP_NUM_THREADS", "1")
