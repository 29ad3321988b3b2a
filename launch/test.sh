#!/usr/bin/env bash
# README command (2): set up and run the whole test suite (lint included). CI runs exactly this.
# Then the GPU-side logic on the CPU: the model, attention and expert tests and the bf16 2-rank layouts again with every
# kernel decision taking its CUDA branch (DSTRAIN_KERNEL_POLICY=cuda; docs/training.md#on-a-gpu-machine).
# Arguments (a test path, -k ...) run just those, once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
.venv/bin/ruff check dstrain tests launch
.venv/bin/ruff format --check dstrain tests launch
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -q -ra "$@"
fi
.venv/bin/python -m pytest -q -ra --durations=15
DSTRAIN_KERNEL_POLICY=cuda exec .venv/bin/python -m pytest -q -ra tests/model/test_attention.py \
  tests/model/test_experts.py tests/model/test_parity.py tests/model/test_dsa.py tests/model/test_gpu_path.py \
  tests/parallel/test_layouts.py::test_bf16_layouts_with_overlapped_reductions
