#!/usr/bin/env bash
# Builds what CONA's Megatron-DeepSpeed backend needs next to a user's checkout, never inside this project:
#   <out>/venv   a Python venv with the versions the backend was verified with (see docs/megatron-deepspeed.md)
#   <out>/shim   an import-only `torchvision` stub (Megatron imports its vision code at module level; GPT
#                training never calls it, and the PyPI torchvision wheels are CUDA builds that fail to import
#                next to the CPU torch)
# and builds the checkout's C++ data helpers once (rank 0 rebuilds them at every start anyway).
#
# Usage: scripts/setup_megatron_deepspeed.sh REPO_PATH [OUT_DIR]     (OUT_DIR defaults to REPO_PATH/../cona-mds)
# Env:   PYTHON (interpreter for the venv, default python3), CONA_TORCH (torch requirement, default torch==2.13.0)
# Then:  cona train ... --repo-path REPO_PATH --mds-python OUT_DIR/venv/bin/python --mds-shim OUT_DIR/shim
#        or export CONA_MEGATRON_DEEPSPEED=REPO_PATH CONA_MEGATRON_DEEPSPEED_PYTHON=OUT_DIR/venv/bin/python
#        CONA_MEGATRON_DEEPSPEED_SHIM=OUT_DIR/shim
set -euo pipefail
if [ $# -lt 1 ] || [ ! -f "$1/pretrain_gpt.py" ]; then
  echo "usage: $0 REPO_PATH [OUT_DIR]  (REPO_PATH must be a Megatron-DeepSpeed checkout with pretrain_gpt.py)" >&2
  exit 2
fi
repo="$(cd "$1" && pwd)"
out="${2:-$(dirname "$repo")/cona-mds}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
python="${PYTHON:-python3}"
torch_req="${CONA_TORCH:-torch==2.13.0}"

if [ ! -x "$out/venv/bin/python" ]; then
  "$python" -m venv "$out/venv"
fi
pip=("$out/venv/bin/python" -m pip install --quiet --disable-pip-version-check)
if ! "$out/venv/bin/python" -c "import torch" 2>/dev/null; then
  "${pip[@]}" "$torch_req"
fi
# deepspeed 0.19.7+ dropped deepspeed/compression/compress.py, which megatron/training.py imports.
"${pip[@]}" "deepspeed==0.19.6" transformers pillow pybind11 nltk regex six numpy

mkdir -p "$out/shim/torchvision"
cat > "$out/shim/torchvision/__init__.py" <<'EOF'
"""Import-only stand-in for torchvision (CONA's Megatron-DeepSpeed set-up): GPT training never uses it."""


def get_image_backend():
    return "PIL"
EOF
cat > "$out/shim/torchvision/transforms.py" <<'EOF'
"""Import-only stand-in: any use of a transform fails loudly instead of doing something wrong."""


def __getattr__(name):
    raise ImportError(f"torchvision.transforms.{name} is a CONA import stub; install real torchvision for vision models")
EOF
cat > "$out/shim/torchvision/datasets.py" <<'EOF'
"""Import-only stand-in: VisionDataset exists so that megatron/data/image_folder.py can subclass it."""


class VisionDataset:
    def __init__(self, *args, **kwargs):
        raise ImportError("torchvision.datasets is a CONA import stub; install real torchvision for vision models")
EOF

(cd "$repo/megatron/data" && PATH="$out/venv/bin:$PATH" make >/dev/null)
PYTHONPATH="$out/shim:$repo" "$out/venv/bin/python" -c "import megatron.training, deepspeed; print('deepspeed', deepspeed.__version__)"
echo "venv:  $out/venv/bin/python"
echo "shim:  $out/shim"
