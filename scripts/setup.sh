#!/usr/bin/env bash
# Install what the package needs into the active Python: PyTorch if none is installed yet (the CPU build where this
# machine keeps one, else the registry's), then the package with its test extras, the rest resolving as a user's
# `pip install` does (the newest versions pyproject.toml allows). PIP_CONSTRAINT=.ci/oldest.txt installs the oldest
# supported set instead. Idempotent: fast when already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(python3 -m pip install --quiet --disable-pip-version-check)
if ! python3 -c "import torch" 2>/dev/null; then
  "${pip[@]}" "torch==2.13.0" 2>/dev/null || "${pip[@]}" "torch>=2.13,<2.16"
fi
"${pip[@]}" -e ".[test]"
