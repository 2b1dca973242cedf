#!/usr/bin/env bash
# Set up a fresh machine and run the whole test suite on CPU (GPU-only tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Tests use tiny models, for which one thread per process is fastest (two contend for the two cores of CI).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python3 -m pytest -q "$@"
