#!/usr/bin/env bash
# Session 5, one GPU (~9 minutes): the FP8 and fused GPU tests left from session 4, the engine with the tiles
# decode schedule (its GPU tests, then decode latency and nano-vllm throughput, split against tiles), and the
# FP8 tiles sweep.
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r5a
say "fp8 + fused tests"
timeout 100 $PYTEST -m gpu tests/test_kernels_fp8_gpu.py tests/test_kernels_decode_write_gpu.py > "$R/gpu_tests_fp8_fused.log" 2>&1
tail -4 "$R/gpu_tests_fp8_fused.log" >> "$R/summary.log"
say "engine GPU tests, tiles schedule"
PAGEDKV_DECODE_SCHEDULE=tiles timeout 110 $PYTEST -m gpu tests/test_gpu_models.py -k "engine or preemption" \
  > "$R/gpu_tests_engine_tiles.log" 2>&1
tail -4 "$R/gpu_tests_engine_tiles.log" >> "$R/summary.log"
for sched in split tiles; do
  say "latency, $sched"
  mkdir -p "$R/lat_$sched"
  PAGEDKV_DECODE_SCHEDULE=$sched timeout 80 python3 -m pagedkv bench latency --models "qwen3-0.6b:1,8,64,256;llama3-8b:1" \
    --impls pagedkv --no-hf-compiled --out "$R/lat_$sched" > "$R/lat_$sched.log" 2>&1
  grep -E "^\|" "$R/lat_$sched.log" | cut -c1-160 >> "$R/summary.log"
done
for sched in split tiles; do
  say "engine nano-vllm, $sched"
  mkdir -p "$R/eng_$sched"
  PAGEDKV_DECODE_SCHEDULE=$sched timeout 75 python3 -m pagedkv bench engine --skip-hf \
    --skip pagedkv_eager,pagedkv_hf_modules --out "$R/eng_$sched" > "$R/eng_$sched.log" 2>&1
  grep -E "^\||Greedy|Error" "$R/eng_$sched.log" | cut -c1-160 >> "$R/summary.log"
done
say "fp8 tiles sweep"
timeout 70 python3 benchmarks/fp8_decode_sweep.py --schedule tiles --block-n 64,128 --warps 2,4 --stages 3 \
  --heads-per-program 1,2 > "$R/fp8_tiles_sweep.jsonl" 2> "$R/fp8_tiles_sweep.err"
cut -c1-300 "$R/fp8_tiles_sweep.jsonl" >> "$R/summary.log"
finish_log
