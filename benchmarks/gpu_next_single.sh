#!/usr/bin/env bash
# What session 4 left unmeasured on one GPU (nvidia-h200, ~9 minutes): the FP8 and fused GPU tests (the
# rewritten rotary-write check), the FP8 tiles sweep, and the drop-in latency with 8 repeats (a steadier P99).
set -u
source benchmarks/gpu_env.sh
start_log /tmp/rnext1
say "fp8 + fused tests"
timeout 110 python3 -m pytest -o addopts= -p no:cacheprovider -q -rf --tb=short -m gpu tests/test_kernels_fp8_gpu.py \
  tests/test_kernels_decode_write_gpu.py > "$R/gpu_tests.log" 2>&1; tail -4 "$R/gpu_tests.log" >> "$R/summary.log"
say "fp8 tiles sweep"
timeout 120 python3 benchmarks/fp8_decode_sweep.py --schedule tiles --block-n 64,128 --warps 2,4 --stages 3 \
  --heads-per-program 1,2 > "$R/fp8_tiles_sweep.jsonl" 2> "$R/fp8_tiles_sweep.err"
cut -c1-300 "$R/fp8_tiles_sweep.jsonl" >> "$R/summary.log"
say "fp8 bits route"
PAGEDKV_FP8_CONVERT=bits timeout 60 python3 benchmarks/fp8_decode_sweep.py --block-n 128 --warps 2 --stages 3 \
  > "$R/fp8_bits_sweep.jsonl" 2> "$R/fp8_bits_sweep.err"
cut -c1-300 "$R/fp8_bits_sweep.jsonl" >> "$R/summary.log"
say "drop-in latency"
timeout 300 python3 -m pagedkv bench hf --only latency --out "$R" > "$R/hf_latency.log" 2>&1
grep -E "^\|" "$R/hf_latency.log" | cut -c1-200 >> "$R/summary.log"
finish_log
