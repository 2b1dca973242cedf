#!/usr/bin/env bash
# Set up a fresh machine and run the whole test suite on CPU (GPU-only tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m pytest -q "$@"
