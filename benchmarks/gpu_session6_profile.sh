#!/usr/bin/env bash
# Session 6, one GPU (~3 minutes): where Llama-3-8B's batch-1 decode step goes, whole and as one TP=2 shard.
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r6p
say "profile"; timeout 400 python3 benchmarks/profile_tp_shard.py "$R" > "$R/profile.log" 2>&1
tail -30 "$R/profile.log" | cut -c1-300 >> "$R/summary.log"
finish_log
