#!/usr/bin/env bash
# On a GPU machine, in one call (under 8 minutes on one H200): the CUDA-only tests
# (CUDA-graph replay equals the plain run, fp32 and bf16), then bf16 throughput and MFU
# of gcompile against torch.compile + fused AdamW for gpt2-small and gpt2-medium.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python -m pytest -o addopts="" -q -m gpu tests/test_gpu.py  # in this process: pytest-xdist may not be installed there
python bench/gpu_check.py "$@"
