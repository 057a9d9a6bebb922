#!/usr/bin/env bash
# Session 5, two GPUs (nvidia-h200-x2, ~4 minutes): routing after the parent-side sender fix, on the default
# workload (32 system prompts) and on 256 prompts over 16 GiB pools, where prefix-aware routing should matter.
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r5x2
say "routing, 32 prompts"; timeout 100 python3 -m pagedkv bench parallel routing --out "$R" > "$R/routing.log" 2>&1
say "routing, 256 prompts"; timeout 110 python3 -m pagedkv bench parallel routing --system-prompts 256 --routing-kv-gib 16 \
  --routing-key routing_256_prompts_16gib --out "$R" >> "$R/routing.log" 2>&1
grep -E "^routing [a-z_]+:|Error" "$R/routing.log" | cut -c1-600 | tee -a "$R/summary.log"
finish_log
