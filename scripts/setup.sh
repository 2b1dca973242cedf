#!/usr/bin/env bash
# Install what the package needs on a fresh machine: PyTorch (the CPU wheel where one is provided locally, else
# the registry's), then the package itself with its test extras. Idempotent: fast when already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check "torch==2.13.0" 2>/dev/null \
  || python3 -m pip install --quiet --disable-pip-version-check "torch>=2.4"
python3 -m pip install --quiet --disable-pip-version-check -e ".[test]"
