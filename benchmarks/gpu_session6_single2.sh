#!/usr/bin/env bash
# Session 6, one GPU (~3 minutes): TP=1 and the TP=2 shard bound again, now with batch 256 and the nano run's
# step breakdown, to set beside TP=2's when two GPUs are lent.
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r6s2
say "tp1, tp2-bound"; timeout 420 python3 -m pagedkv bench parallel tp1 tp2-bound --out "$R" > "$R/tp.log" 2>&1
grep -E "^tp|Error" "$R/tp.log" | cut -c1-600 | tee -a "$R/summary.log"
finish_log
