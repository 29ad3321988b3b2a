#!/usr/bin/env bash
# README command (1): set up .venv and run the main job. With no arguments: the tiny preset on the built-in
# Shakespeare text, ZeRO-1, 2 ranks (CPU: DeepSpeed's CPU accelerator over gloo; GPUs: nccl), ~1-2 minutes
# on 2 CPU cores. Any arguments are passed to dstrain/train.py, e.g.
#   bash launch/train.sh --config zero3 --max_steps 100
#   NPROC=8 bash launch/train.sh --config zero3 --model small --precision bf16
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
if [ -z "${NPROC:-}" ]; then
  NPROC=$(.venv/bin/python -c "import torch; print(torch.cuda.device_count() or 2)")
fi
# The deepspeed launcher detects the accelerator itself; say it explicitly on a CPU-only machine so neither
# the launcher nor the ranks probe for others. A machine with a GPU that CUDA cannot start (a torch wheel for
# a newer driver) is not CPU-only: the ranks then stop with one line saying why (`dstrain env` says more).
if ! .venv/bin/python -c "import sys, torch; from dstrain.dist import gpu_present
sys.exit(0 if torch.cuda.is_available() or gpu_present() else 1)"; then
  export DS_ACCELERATOR=cpu
fi
exec .venv/bin/deepspeed --num_gpus "$NPROC" --master_port "${MASTER_PORT:-29561}" dstrain/train.py "$@"
