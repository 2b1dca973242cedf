#!/usr/bin/env bash
# The test suite against an upstream release that pyproject.toml does not allow yet, or a pre-release, in a throwaway
# virtual environment, so that a new transformers release is checked the day it appears:
#   bash scripts/check_upstream.sh transformers==5.25.0
#   bash scripts/check_upstream.sh --pre transformers                       # the newest pre-release
#   bash scripts/check_upstream.sh transformers==5.25.0 torch==2.15.0 -- tests/test_generation.py -x
# Everything before `--` goes to `pip install --upgrade` after the package is installed as a user gets it; what
# follows `--` goes to pytest. pip then reports that vaswani's own range excludes the release; that is the point.
# When the suite passes, raise the bound in pyproject.toml (and .ci/run tests it from then on).
set -euo pipefail
cd "$(dirname "$0")/.."
requirements=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do requirements+=("$1"); shift; done
[ $# -gt 0 ] && shift  # the `--`
if [ ${#requirements[@]} -eq 0 ]; then
  echo "usage: bash scripts/check_upstream.sh REQUIREMENT... [-- PYTEST_ARGS...]  (e.g. transformers==5.25.0)" >&2
  exit 2
fi
env_dir=$(mktemp -d)
trap 'rm -rf "$env_dir"' EXIT
python3 -m venv "$env_dir"
source "$env_dir/bin/activate"
bash scripts/setup.sh
python -m pip install --quiet --disable-pip-version-check --upgrade "${requirements[@]}"
python -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|tokenizers|datasets|accelerate|safetensors|huggingface.hub) "
OMP_NUM_THREADS=1 python -m pytest -q "$@"
