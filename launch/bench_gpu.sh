#!/usr/bin/env bash
# dstrain on one GPU, one command, at most CAP seconds (480 by default): `dstrain env`, the smoke, the model
# step against transformers (bench_model.py v2lite-4), real `deepspeed --num_gpus 1 dstrain/train.py` runs of
# the V2-Lite-4 folder it writes (ZeRO-1 and ZeRO-3, eager and --compile: tokens/s and MFU) and the top kernels
# of a profiled ZeRO-1 step. `dsa`: DeepSeek Sparse Attention instead (bench_dsa.py: its Triton kernels against
# the torch path in fp32 and bf16, then dense MLA, the dense and the sparse stage from 4K to 64K tokens, and the
# top kernels of each one's 16K step). From the project root:
#   bash launch/bench_gpu.sh                  # OUT=/tmp/bench_gpu: log.txt, each run's metrics.jsonl
#   bash launch/bench_gpu.sh dsa              # OUT=/tmp/bench_gpu: log.txt, dsa/ traces
#   bash launch/bench_gpu.sh round5           # the stored FP8 base's LoRA step, a Kimi Linear (KDA) step
# A part that would not fit the time left is skipped (said in the log). Unmeasured so far: written without a GPU.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/bench_gpu}; CAP=${CAP:-480}; LOG=$OUT/log.txt; RUNS=$OUT/runs; FOLDER=$OUT/v2lite4
mkdir -p "$OUT" "$RUNS"; : >"$LOG"; T0=$(date +%s)
# the launcher's module where a `pip --target` install left no `deepspeed` script on PATH
if command -v deepspeed >/dev/null; then DS=(deepspeed); else DS=("$PY" -m deepspeed.launcher.runner); fi
left() { echo $(( CAP - ($(date +%s) - T0) )); }
say() { echo "=== +$(( $(date +%s) - T0 ))s $*" | tee -a "$LOG"; }
part() {  # seconds at most, name, command...: run it with the smaller of its limit and the time left
  local to=$1 name=$2; shift 2
  [ "$(left)" -lt 20 ] && { say "skip $name: $(left) s left"; return; }
  [ "$to" -gt "$(left)" ] && to=$(left)
  say "$name (<= $to s)"; timeout "$to" "$@" 2>&1 | tee -a "$LOG" | tail -n 40; echo "rc=${PIPESTATUS[0]}" >>"$LOG"
}
run_ds() {  # name, steps, seconds at most, dstrain train args...: stopped once the steps are logged
  local name=$1 n=$2 to=$3; shift 3
  [ "$(left)" -lt 30 ] && { say "skip $name: $(left) s left"; return; }
  [ "$to" -gt "$(left)" ] && to=$(left)
  say "deepspeed $name ($n steps, <= $to s): $*"
  local dir=$RUNS/$name m=$RUNS/$name/metrics.jsonl
  setsid "${DS[@]}" --num_gpus 1 dstrain/train.py --output_dir "$dir" --log_every 1 --max_steps 100000 \
    --save_every 0 --no-plots "$@" >>"$LOG" 2>&1 &
  local pid=$! t=$(date +%s)
  while kill -0 $pid 2>/dev/null; do
    [ -f "$m" ] && [ "$(grep -c '"tokens_per_s"' "$m")" -ge "$n" ] && break
    [ $(( $(date +%s) - t )) -ge "$to" ] && { say "$name: time limit"; break; }
    sleep 1
  done
  kill -9 -- -$pid 2>/dev/null; wait $pid 2>/dev/null
  [ -f "$m" ] && $PY launch/gpu_report.py run "$name" "$m" | tee -a "$LOG"
  for f in "$dir"/profile/*.json; do [ -f "$f" ] && $PY launch/gpu_report.py trace "$f" 20 | tee -a "$LOG"; done
  rm -rf "$dir"/checkpoints "$dir"/profile
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$LOG"
if [ "${1:-}" = round5 ]; then  # this round's GPU work: the stored FP8 base's LoRA step, a KDA-hybrid step
  part 60 "dstrain env" $PY -m dstrain env
  part 180 "LoRA step: stored FP8 base against a bf16 base" $PY launch/bench_lora.py --device cuda --stored --rounds 2
  part 150 "Kimi Linear step against transformers (fla's kernels where installed)" $PY launch/bench_kda.py \
    --device cuda --dtype bf16 --seq_len 4096 --batch 2 --rounds 2
  say "end ($(left) s left)"
  exit 0
fi
if [ "${1:-}" = dsa ]; then
  part 120 "DSA kernels against the torch path" $PY launch/bench_dsa.py --device cuda --check
  part 150 "DSA profiled at 16K" $PY launch/bench_dsa.py --device cuda --lengths 16384 --rounds 1 \
    --profile "$OUT/dsa"
  for f in "$OUT"/dsa/*.json; do [ -f "$f" ] && say "top kernels: $f" && $PY launch/gpu_report.py trace "$f" 12 | tee -a "$LOG"; done
  part 240 "DSA stages, 4K to 64K" $PY launch/bench_dsa.py --device cuda
  say "end ($(left) s left)"
  exit 0
fi
part 60 "dstrain env" $PY -m dstrain env
part 90 "smoke" $PY -m dstrain smoke --device cuda
part 150 "model step against transformers" $PY launch/bench_model.py --device cuda --configs v2lite-4 \
  --figures speed,memory --rounds 2
part 60 "V2-Lite-4 folder" $PY launch/gpu_report.py folder "$FOLDER"
COMMON="--model $FOLDER --precision bf16 --seq_len 4096 --micro_batch_size 2"
run_ds z1_eager 10 60 $COMMON --config zero1 --profile_steps 8:8
run_ds z1_compile 10 80 $COMMON --config zero1 --compile
run_ds z3_eager 8 50 $COMMON --config zero3
run_ds z3_compile 8 70 $COMMON --config zero3 --compile
say "end ($(left) s left); figures: grep '\"run\"' $LOG"
