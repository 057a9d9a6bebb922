#!/usr/bin/env bash
# Session 5, one GPU (~5 minutes): FP8 with the tiles schedule (64-token tiles, 2 warps) in the engine: its FP8
# engine GPU tests, the KV-bound workload, and nano-vllm's workload with FP8 KV, split against tiles.
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r5d
say "fp8 engine + graph tests, tiles"
PAGEDKV_DECODE_SCHEDULE=tiles timeout 80 $PYTEST -m gpu tests/test_kernels_fp8_gpu.py -k "engine or graph" \
  > "$R/gpu_tests_fp8_tiles.log" 2>&1
tail -3 "$R/gpu_tests_fp8_tiles.log" >> "$R/summary.log"
say "kv-bound engine, tiles"
mkdir -p "$R/kv_tiles"
PAGEDKV_DECODE_SCHEDULE=tiles timeout 150 python3 -m pagedkv bench engine --preset kv-bound --out "$R/kv_tiles" \
  > "$R/kv_tiles.log" 2>&1
grep -E "^\||Target|Error" "$R/kv_tiles.log" | cut -c1-200 >> "$R/summary.log"
for sched in split tiles; do
  say "nano-vllm fp8, $sched"
  mkdir -p "$R/eng_fp8_$sched"
  PAGEDKV_DECODE_SCHEDULE=$sched timeout 80 python3 -m pagedkv bench engine --skip-hf --kv-cache-dtype fp8_e4m3 \
    --skip pagedkv_eager,pagedkv_hf_modules --out "$R/eng_fp8_$sched" > "$R/eng_fp8_$sched.log" 2>&1
  grep -E "tok/s \(|Error" "$R/eng_fp8_$sched.log" | cut -c1-160 >> "$R/summary.log"
done
finish_log
