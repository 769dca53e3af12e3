#!/usr/bin/env bash
# Build the wheel bundle the lent GPU machine lacks (Ray and what Train/Tune/Data need), under 60 MiB:
#
#   bash bench/gpu_bundle.sh [--python-version 3.12] [--output gpu-bundle]
#
# Needs pip and a reachable package index here (never there). What it carries and why: bench/gpu_bundle.py.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-}"
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
exec "$python" -m bench.gpu_bundle "$@"
