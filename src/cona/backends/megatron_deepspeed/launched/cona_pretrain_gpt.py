"""The script CONA's ``deepspeed`` launcher runs instead of the checkout's ``pretrain_gpt.py``.

It installs CONA's hooks on ``megatron.training`` (:mod:`cona_megatron_hooks`: gradient-noise inputs, the
stop rules) and then runs the checkout's ``pretrain_gpt.py`` (env ``CONA_MDS_SCRIPT``) as ``__main__`` with
the same arguments, so the checkout itself is never edited. The launcher puts ``--local_rank=N`` first among
the arguments, which is why the script's path travels in the environment rather than on the command line.
"""

import os
import runpy
import sys

SCRIPT_ENV = "CONA_MDS_SCRIPT"


def main() -> None:
    script = os.environ.get(SCRIPT_ENV)
    if not script or not os.path.isfile(script):
        raise SystemExit(f"cona_pretrain_gpt.py: {SCRIPT_ENV}={script!r} does not name pretrain_gpt.py")
    import cona_megatron_hooks
    import megatron.training

    cona_megatron_hooks.install(megatron.training)
    sys.argv[0] = script
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
