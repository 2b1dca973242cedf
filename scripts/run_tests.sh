#!/usr/bin/env bash
# Set up a fresh machine and run the whole test suite on CPU (GPU-only tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Tests use tiny models, for which one thread per process is fastest: pytest-xdist runs one test process per CPU
# instead (at most 8; TEST_PROCESSES=N sets the number, 0 runs everything in this process), each taking whole test
# files, so that a file's module fixtures (a trained model, a torchrun launch) are built once.
# The longest files go first (tests/conftest.py: LONGEST_FIRST), so that the run does not end on one of them.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc counts no more CPUs than those variables name
# --quick: the edit loop's tier, every test that starts no process and is not marked slow (tests/conftest.py skips a
# test at the moment it starts a process). CI runs the whole suite. Each run ends with its 15 slowest tests.
tier=()
if [ "${1:-}" = "--quick" ]; then
  shift
  export VASWANI_QUICK_TESTS=1
  tier=(-m "not slow")
fi
python3 -m pytest -q -n "${TEST_PROCESSES:-$((cpus < 8 ? cpus : 8))}" --dist loadfile --no-loadscope-reorder --durations=15 \
  "${tier[@]}" "$@"
