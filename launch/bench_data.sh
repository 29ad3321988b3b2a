#!/usr/bin/env bash
# Data pipeline benchmark: `dstrain data stats` (counts, row fill, tokenize+pack speed vs the raw tokenizer,
# A/B interleaved in one process) on the shared data sets at seq_len 2048, one JSON object per line.
# Usage: bash launch/bench_data.sh [extra `dstrain data stats` flags, e.g. --tokenizer DIR --rounds 5]
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="${DATA_DIR:-../shared/data}"
for f in tinyshakespeare.txt self_instruct_seed_tasks.jsonl sharegpt_conversations.json; do
  .venv/bin/dstrain data stats --data "$DATA/$f" --seq_len 2048 --json "$@"
done
