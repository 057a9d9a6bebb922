#!/usr/bin/env bash
# Session 6, one GPU (~2 minutes): the batch-256 decode step's timeline (GPU busy share, idle gaps, host phases).
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r6b
say "b256 profile"; timeout 300 python3 benchmarks/profile_b256.py "$R" > "$R/profile.log" 2>&1
tail -70 "$R/profile.log" | cut -c1-300 >> "$R/summary.log"
gzip -f "$R/b256_trace.json" 2>/dev/null
finish_log
