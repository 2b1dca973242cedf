#!/usr/bin/env bash
# Set up a fresh machine and run the whole test suite on CPU (GPU-only tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Tests use tiny models, for which one thread per process is fastest: pytest-xdist runs one test process per CPU
# instead (at most 8; TEST_PROCESSES=N sets the number, 0 runs everything in this process), each taking whole test
# files, so that a file's module fixtures (a trained model, a torchrun launch) are built once.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc counts no more CPUs than those variables name
python3 -m pytest -q -n "${TEST_PROCESSES:-$((cpus < 8 ? cpus : 8))}" --dist loadfile "$@"
