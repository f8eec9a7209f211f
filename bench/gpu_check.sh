#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py) from a plain checkout: no install, only torch, transformers,
# safetensors, pyarrow and numpy needed. Writes $OUT/gpu_check.json when OUT is set.
#   bash bench/gpu_check.sh              # on a CUDA machine, under 8 minutes on one H200
#   bash bench/gpu_check.sh --dry-run    # CPU, gloo, tiny shapes, seconds
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" bench/gpu_check.py "$@"
