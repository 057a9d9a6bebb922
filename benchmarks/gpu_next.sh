#!/usr/bin/env bash
# What session 4 left unmeasured, for one two-GPU call (nvidia-h200-x2, ~9 minutes). Stage 1 uses both
# GPUs: routing after the parent-side sender fix (default workload, then 256 prefixes over 16 GiB pools),
# TP=2 with NCCL's and with the symmetric-memory all-reduce, and the TP GPU tests (both all-reduces).
# Stage 2 lanes: GPU 0 the FP8 tiles sweep; GPU 1 the FP8 GPU tests (the rewritten rotary-write check).
set -u
source benchmarks/gpu_env.sh
R=/tmp/rnext; mkdir -p "$R"
T0=$(date +%s); say() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$R/summary.log"; }
PYTEST="python3 -m pytest -o addopts= -p no:cacheprovider -q -rf --tb=short"
say "routing, 32 prompts"; timeout 110 python3 -m pagedkv bench parallel routing --out "$R" > "$R/routing.log" 2>&1
say "routing, 256 prompts"; timeout 120 python3 -m pagedkv bench parallel routing --system-prompts 256 --routing-kv-gib 16 \
  --routing-key routing_256_prompts_16gib --out "$R" >> "$R/routing.log" 2>&1
grep -E "^routing [a-z_]+:|Error" "$R/routing.log" | cut -c1-600 | tee -a "$R/summary.log"
say "tp2, tp2-symm"; timeout 200 python3 -m pagedkv bench parallel tp2 tp2-symm --out "$R" > "$R/tp.log" 2>&1
grep -E "^tp2|Error" "$R/tp.log" | cut -c1-400 | tee -a "$R/summary.log"
say "TP GPU tests"; timeout 90 $PYTEST -m gpu tests/test_tensor_parallel_gpu.py > "$R/tp_tests.log" 2>&1
tail -4 "$R/tp_tests.log" >> "$R/summary.log"
( export CUDA_VISIBLE_DEVICES=0; say "gpu0: fp8 tiles sweep"
  timeout 100 python3 benchmarks/fp8_decode_sweep.py --schedule tiles --block-n 64,128 --warps 2,4 --stages 3 \
    --heads-per-program 1,2 > "$R/fp8_tiles_sweep.jsonl" 2> "$R/fp8_tiles_sweep.err" ) &
( export CUDA_VISIBLE_DEVICES=1; say "gpu1: fp8 + fused tests"
  timeout 100 $PYTEST -m gpu tests/test_kernels_fp8_gpu.py tests/test_kernels_decode_write_gpu.py > "$R/fp8_tests.log" 2>&1
  tail -4 "$R/fp8_tests.log" >> "$R/summary.log" ) &
wait
say "done"
tar czf "$OUT/results.tgz" -C "$R" . ; cp "$R/summary.log" "$OUT/"; tail -c 11000 "$R/summary.log"
