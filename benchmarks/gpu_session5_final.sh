#!/usr/bin/env bash
# Session 5, one GPU, final call (~6 minutes): the FP8 GPU tests on the new FP8 default, the kernel GPU suite at the session's last kernel change (split,
# tiles, fused write+decode), then the integer-op FP8 conversion route timed against the default.
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r5f
PYTEST="python3 -m pytest -o addopts= -p no:cacheprovider -q -rf --tb=short"
say "FP8 GPU tests (tiles now FP8's default)"
timeout 120 $PYTEST -m gpu tests/test_kernels_fp8_gpu.py > "$R/fp8_tests.log" 2>&1
tail -4 "$R/fp8_tests.log" >> "$R/summary.log"
say "kernel GPU tests"
timeout 150 $PYTEST -m gpu tests/test_kernels_gpu.py tests/test_decode_tiles.py > "$R/kernel_tests.log" 2>&1
tail -4 "$R/kernel_tests.log" >> "$R/summary.log"
say "fused write+decode GPU tests"
timeout 80 $PYTEST -m gpu tests/test_kernels_decode_write_gpu.py > "$R/decode_write_tests.log" 2>&1
tail -4 "$R/decode_write_tests.log" >> "$R/summary.log"
say "fp8 bits route"
PAGEDKV_FP8_CONVERT=bits timeout 40 python3 benchmarks/fp8_decode_sweep.py --block-n 128 --warps 2 --stages 3 \
  > "$R/fp8_bits.jsonl" 2> "$R/fp8_bits.err"
cut -c1-300 "$R/fp8_bits.jsonl" >> "$R/summary.log"
finish_log
