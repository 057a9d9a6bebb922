#!/usr/bin/env bash
# Session 5, one GPU (~3 minutes): the GPU tests the final check's slots cut (tiles GPU tests, the FP8 engine
# tests), then `bench kernel --kv-dtype fp8_e4m3 --fp8-only` with FP8's new default (tiles) in the table.
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r5g
say "tiles + FP8 engine GPU tests"
timeout 110 $PYTEST -m gpu tests/test_decode_tiles.py tests/test_kernels_fp8_gpu.py -k "tiles_gpu or engine" \
  > "$R/tests.log" 2>&1
tail -4 "$R/tests.log" >> "$R/summary.log"
say "bench kernel, FP8 only (FP8's default is tiles now)"
mkdir -p "$R/kernel_fp8"
timeout 100 python3 -m pagedkv bench kernel --kv-dtype fp8_e4m3 --fp8-only --out "$R/kernel_fp8" > "$R/kernel_fp8.log" 2>&1
grep -E "fp8 decode|MISSED|met" "$R/kernel_fp8.log" | cut -c1-220 | tail -20 >> "$R/summary.log"
finish_log
