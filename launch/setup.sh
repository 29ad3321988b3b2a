#!/usr/bin/env bash
# Create or reuse .venv and install dstrain into it. Safe to run repeatedly: it reinstalls only when
# pyproject.toml changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.dstrain-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned: this resolves to the CPU build on machines without CUDA and keeps
  # deepspeed's own dependency resolution from pulling a CUDA build.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
