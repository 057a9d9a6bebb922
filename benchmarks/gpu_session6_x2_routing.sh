#!/usr/bin/env bash
# Session 6, two GPUs, call B (~4 minutes): routing after the parent-side sender fix, on the workload
# (32 system prompts) and on 256 prompts over 16 GiB pools (prefixes that overflow a replica's pool).
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r6x2b
say "routing, 32 prompts"; timeout 120 python3 -m pagedkv bench parallel routing --out "$R" > "$R/routing.log" 2>&1
say "routing, 256 prompts"; timeout 130 python3 -m pagedkv bench parallel routing --system-prompts 256 --routing-kv-gib 16 \
  --routing-key routing_256_prompts_16gib --out "$R" >> "$R/routing.log" 2>&1
grep -E "^routing[a-z_0-9]* |Error" "$R/routing.log" | cut -c1-900 | tee -a "$R/summary.log"
finish_log
