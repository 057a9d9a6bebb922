#!/usr/bin/env bash
# Session 5, one GPU, final check (~5 minutes): the FP8 GPU tests on the new FP8 default (tiles), the kernel GPU
# suite at the session's last kernel change, and the fused write+decode GPU tests if time is left.
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r5f
say "FP8 GPU tests (tiles now FP8's default)"
timeout 120 $PYTEST -m gpu tests/test_kernels_fp8_gpu.py > "$R/fp8_tests.log" 2>&1
tail -4 "$R/fp8_tests.log" >> "$R/summary.log"
say "kernel GPU tests"
timeout 140 $PYTEST -m gpu tests/test_kernels_gpu.py tests/test_decode_tiles.py > "$R/kernel_tests.log" 2>&1
tail -4 "$R/kernel_tests.log" >> "$R/summary.log"
if [ $(( $(date +%s) - T0 )) -lt 250 ]; then
  say "fused write+decode GPU tests"
  timeout $(( 330 - ($(date +%s) - T0) )) $PYTEST -m gpu tests/test_kernels_decode_write_gpu.py > "$R/decode_write_tests.log" 2>&1
  tail -4 "$R/decode_write_tests.log" >> "$R/summary.log"
fi
finish_log
