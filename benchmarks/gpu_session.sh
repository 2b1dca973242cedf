#!/usr/bin/env bash
# The GPU plan, benchmarks/gpu_plan.py (its docstring says how to call it).
exec python3 "$(dirname "$0")/gpu_plan.py" "$@"
