#!/usr/bin/env bash
# Install pdserve and what it needs. Usage: bash scripts/install.sh [--test]
#   --test  also the test tools, the demo-model builder and the real sglang-router binary.
# A CUDA torch that is already installed is kept; otherwise a CPU-only machine gets the CPU
# wheel (torch==2.13.0+cpu), which avoids pulling a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP="$PY -m pip install --disable-pip-version-check -q"

if ! $PY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PIP torch
  else
    $PIP "torch==2.13.0" || $PIP "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
  fi
fi

if [ "${1:-}" = "--test" ]; then
  $PIP -e ".[demo,bench,test]"
  # the real Rust router, for the wire-compatibility tests (a plain wheel, no torch)
  $PIP "sglang-router==0.3.2" || echo "install.sh: sglang-router could not be installed on this platform" >&2
else
  $PIP -e ".[demo,bench]"
fi
