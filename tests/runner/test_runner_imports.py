"""The runner process imports no torch: it launches and watches the workers, which do. Importing torch and
``torch.distributed.checkpoint`` takes seconds (6-8 s on some GPU hosts), which every run would pay before
its first stage starts."""

from __future__ import annotations

import subprocess
import sys
import textwrap

RUNNER_MODULES = (
    "cona.cli",
    "cona.commands.train",
    "cona.commands.train_runs",
    "cona.runner.chain_file",
    "cona.runner.run_descriptions",
    "cona.runner.schedules.online",
    "cona.runner.stage_run",
    "cona.runner.worker_session",
    "cona.runner.publish",
    "cona.runner.views.status",
)


def torch_imported(code: str) -> bool:
    """Whether running ``code`` in a fresh interpreter imports torch."""
    script = code + "\nimport sys\nprint('torch' in sys.modules)\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return result.stdout.strip().splitlines()[-1] == "True"


def test_the_runners_modules_import_no_torch():
    assert not torch_imported("\n".join(f"import {module}" for module in RUNNER_MODULES))
    assert torch_imported("import cona.engine.checkpoint.save")  # the check can fail


def test_the_device_is_asked_of_torch_only_where_the_config_leaves_it_open():
    ask = textwrap.dedent("""
        from cona.commands.train_runs import device_type
        from cona.config import TrainingConfig
        assert device_type(TrainingConfig(device="cpu"), processes=2) == "cpu"
        assert device_type(TrainingConfig(device="cuda")) == "cuda"
    """)
    assert not torch_imported(ask)
    # "auto" asks CUDA; so does a GPU count (a CUDA run needs a GPU for each process).
    assert torch_imported(ask + "\ndevice_type(TrainingConfig(device='auto'))")
    counted = "try:\n    device_type(TrainingConfig(device='cuda'), processes=1)\nexcept Exception:\n    pass"
    assert torch_imported(ask + counted)  # no GPU here: the LaunchError is expected
