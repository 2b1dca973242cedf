#!/usr/bin/env bash
# Install the package with its test extras into the active Python, every dependency (PyTorch included) resolving as
# a user's `pip install` resolves it: the newest versions pyproject.toml allows, from the indexes this machine's pip
# is configured with (a CPU build of PyTorch where that is what they offer as newest). pyproject.toml is the one
# place versions are decided. PIP_CONSTRAINT=.ci/oldest.txt installs the oldest supported set instead. Idempotent:
# fast when already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e ".[test]"
