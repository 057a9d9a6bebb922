#!/usr/bin/env bash
# What session 4 left unmeasured, for one two-GPU call (nvidia-h200-x2, ~8 minutes). Stage 1 uses both
# GPUs: routing after the parent-side sender fix (default workload, then 256 prefixes over 16 GiB pools),
# TP=2 with NCCL's and with the symmetric-memory all-reduce, and the TP GPU tests (both all-reduces).
# The one-GPU part is benchmarks/gpu_next_single.sh.
set -u
source benchmarks/gpu_env.sh
start_log /tmp/rnext
say "routing, 32 prompts"; timeout 110 python3 -m pagedkv bench parallel routing --out "$R" > "$R/routing.log" 2>&1
say "routing, 256 prompts"; timeout 120 python3 -m pagedkv bench parallel routing --system-prompts 256 --routing-kv-gib 16 \
  --routing-key routing_256_prompts_16gib --out "$R" >> "$R/routing.log" 2>&1
grep -E "^routing [a-z_]+:|Error" "$R/routing.log" | cut -c1-600 | tee -a "$R/summary.log"
say "tp2, tp2-symm"; timeout 200 python3 -m pagedkv bench parallel tp2 tp2-symm --out "$R" > "$R/tp.log" 2>&1
grep -E "^tp2|Error" "$R/tp.log" | cut -c1-400 | tee -a "$R/summary.log"
say "TP GPU tests"; timeout 90 $PYTEST -m gpu tests/test_tensor_parallel_gpu.py > "$R/tp_tests.log" 2>&1
tail -4 "$R/tp_tests.log" >> "$R/summary.log"
finish_log
