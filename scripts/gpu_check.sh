#!/usr/bin/env bash
# One short call on a machine with a GPU: overlap timings and greedy equality on a random Qwen3-8B-shaped target.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
"$PY" scripts/gpu_check.py "$@"
