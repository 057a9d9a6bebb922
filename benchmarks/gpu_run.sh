#!/usr/bin/env bash
# The GPU runner: the benchmarks and GPU tests of pagedkv, by stage, on a machine with CUDA GPUs.
#
# Run it from the repository root on the GPU machine (no install needed: it runs from src/):
#
#     git rev-parse --short HEAD > .commit        # on the machine you copy from, so results name it
#     OUT=/tmp/out bash benchmarks/gpu_run.sh engine latency
#
# Each stage writes its JSON, markdown and log under $OUT/STAGE/; $OUT/summary.log gets one line per
# stage with its wall time and exit status, and $OUT/results.tgz packs everything (for tools that
# bring back only a few files). A stage that fails is reported, the next one still runs, and the
# script exits 1.
#
# Stages (one GPU unless said):
#   engine    `bench engine`: nano-vllm's workload, own decoder with graphs, eager and HF modules
#             (HF's continuous batching skipped: it cannot finish in minutes); then FP8 KV (tiles)
#   latency   `bench latency`: decode step at batch 1..256 against the roofline, HF compiled batch 1
#   kernels   `bench kernel --validate`: paged decode/prefill against SDPA and copy; FP8 decode
#   sweep     benchmarks/tools/decode_sweep.py: the tiles schedule's launch configurations (~4 min)
#   dropin    `bench hf`: PagedCache memory, then its decode latency against DynamicCache
#   fp8       `bench engine --preset kv-bound` in bf16 and FP8, and `bench kernel --fp8-only`
#   profile   benchmarks/tools/profile_engine.py and profile_b256.py: where a decode step's time goes
#   parallel  (2 GPUs) `bench parallel`: TP=1/TP=2 (NCCL and one-shot), DP, routing on 32 and 256
#             system prompts; the all-reduce per call
#   tests     every GPU-marked test (`pytest -m gpu tests/`)
#
# Environment: $OUT (default /tmp/out), $PAGEDKV_COMMIT (default: .commit, else git), $BUDGET_S for
# `bench kernel`'s time budget (default 240).
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
if [ "$PAGEDKV_COMMIT" = unknown ] && git rev-parse --git-dir >/dev/null 2>&1; then
  export PAGEDKV_COMMIT=$(git rev-parse --short HEAD)
fi
BUDGET_S=${BUDGET_S:-240}
[ $# -gt 0 ] || { sed -n '2,28p' "$0"; exit 2; }

start_log "$OUT/run"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv > "$R/nvidia_smi.txt" 2>&1
say "commit $PAGEDKV_COMMIT; $(nvidia-smi -L 2>/dev/null | head -1)"
BENCH="python3 -m pagedkv bench"

run_stage() {  # run_stage NAME: the stage's commands, output in $OUT/NAME/
  local name=$1 dir="$OUT/$1"
  mkdir -p "$dir"
  case $name in
    engine)
      $BENCH engine --skip-hf --out "$dir"
      PAGEDKV_DECODE_SCHEDULE=tiles $BENCH engine --skip-hf --skip pagedkv_hf_modules \
        --kv-cache-dtype fp8_e4m3 --out "$dir/fp8" ;;
    latency)
      $BENCH latency --out "$dir" ;;
    kernels)
      $BENCH kernel --validate --variants --budget-s "$BUDGET_S" --out "$dir"
      $BENCH kernel --kv-dtype fp8_e4m3 --fp8-only --out "$dir/fp8" ;;
    sweep)
      python3 benchmarks/tools/decode_sweep.py --out "$dir" --budget-s "$BUDGET_S" ;;
    dropin)
      $BENCH hf --out "$dir" ;;
    fp8)
      $BENCH engine --preset kv-bound --out "$dir"
      $BENCH kernel --kv-dtype fp8_e4m3 --fp8-only --out "$dir" ;;
    profile)
      python3 benchmarks/tools/profile_engine.py "$dir"
      python3 benchmarks/tools/profile_b256.py "$dir" ;;
    parallel)
      nvidia-smi topo -m > "$dir/topo.txt" 2>&1
      python3 benchmarks/tools/all_reduce_bench.py "$dir/all_reduce.jsonl"
      $BENCH parallel tp1 tp2 tp2-symm tp-greedy dp1 dp2 --out "$dir"
      $BENCH parallel routing --out "$dir"
      $BENCH parallel routing --system-prompts 256 --routing-kv-gib 16 \
        --routing-key routing_256_prompts_16gib --out "$dir" ;;
    tests)
      $PYTEST -m gpu tests/ ;;
    *)
      echo "unknown stage $name (see the top of benchmarks/gpu_run.sh)"; return 2 ;;
  esac
}

failed=0
for stage in "$@"; do
  t0=$(date +%s)
  run_stage "$stage" > "$OUT/$stage.log" 2>&1
  status=$?
  tail -n 30 "$OUT/$stage.log"
  mkdir -p "$OUT/$stage"; mv "$OUT/$stage.log" "$OUT/$stage/"
  [ $status -eq 0 ] || failed=1
  say "$stage: exit $status in $(( $(date +%s) - t0 )) s"
done
finish_log
exit $failed
