#!/usr/bin/env bash
# Session 5, two GPUs (nvidia-h200-x2, <= 10 minutes): routing after the parent-side sender fix (32 prompts,
# then 256 prompts over 16 GiB pools), TP=2 with NCCL's and the symmetric-memory all-reduce in one run, the TP
# GPU tests, and the FP8 and kernel GPU suites on one GPU if time is left.
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r5x2
PYTEST="python3 -m pytest -o addopts= -p no:cacheprovider -q -rf --tb=short"
say "routing, 32 prompts"; timeout 100 python3 -m pagedkv bench parallel routing --out "$R" > "$R/routing.log" 2>&1
say "routing, 256 prompts"; timeout 110 python3 -m pagedkv bench parallel routing --system-prompts 256 --routing-kv-gib 16 \
  --routing-key routing_256_prompts_16gib --out "$R" >> "$R/routing.log" 2>&1
grep -E "^routing [a-z_]+:|Error" "$R/routing.log" | cut -c1-600 | tee -a "$R/summary.log"
say "tp2, tp2-symm"; timeout 200 python3 -m pagedkv bench parallel tp2 tp2-symm --out "$R" > "$R/tp.log" 2>&1
grep -E "^tp2|Error" "$R/tp.log" | cut -c1-400 | tee -a "$R/summary.log"
say "TP GPU tests"; timeout 80 $PYTEST -m gpu tests/test_tensor_parallel_gpu.py > "$R/tp_tests.log" 2>&1
tail -4 "$R/tp_tests.log" >> "$R/summary.log"
if [ $(( $(date +%s) - T0 )) -lt 480 ]; then
  say "FP8 and kernel GPU tests"; CUDA_VISIBLE_DEVICES=0 timeout $(( 565 - ($(date +%s) - T0) )) $PYTEST -m gpu \
    tests/test_kernels_fp8_gpu.py tests/test_kernels_gpu.py tests/test_decode_tiles.py > "$R/kernel_tests.log" 2>&1
  tail -4 "$R/kernel_tests.log" >> "$R/summary.log"
fi
finish_log
