#!/usr/bin/env bash
# Set up a fresh machine (CPU torch from the local wheel or PyPI, the package with its test extras) and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet "torch==2.13.0" 2>/dev/null || python3 -m pip install --quiet torch
python3 -m pip install --quiet -e ".[test]"
python3 -m pytest -q "$@"
