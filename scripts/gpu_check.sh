#!/usr/bin/env bash
# GPU check of memory injection (baton/bench/gpu_check.py): on a GPU machine with the CUDA vllm
# (pip install -e ".[gpu]") and SmolLM2 under .cache/models (make setup provisions it), one engine
# with gpu_example.yaml's decode settings: exact injection equality and TTFT at k = 5 / k = 50.
#   scripts/gpu_check.sh                 (cuda; exits 2 when there is no CUDA device)
#   scripts/gpu_check.sh --device cpu    (the same check on CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${BATON_PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" -m baton.bench.gpu_check "$@"
