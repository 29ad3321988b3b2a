#!/usr/bin/env bash
# README command (2): set up and run the whole test suite (lint included). CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
.venv/bin/ruff check dstrain tests launch
.venv/bin/ruff format --check dstrain tests launch
exec .venv/bin/python -m pytest -q -ra "$@"
