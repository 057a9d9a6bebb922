#!/usr/bin/env bash
# Session 6, one GPU (~5 minutes): Llama-3-8B TP=1 at this commit beside one TP=2 rank's shard run as a
# whole model (`bench parallel tp2-bound`: the TP=2 step without communication), and the engine's host
# time per decode step on this machine's CPU (benchmarks/host_overhead.py, device stubbed out).
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r6s
say "host overhead"; for b in 1 64 256; do timeout 60 python3 benchmarks/host_overhead.py $b 50 2>&1 | tail -1 | tee -a "$R/summary.log"; done
say "tp1, tp2-bound"; timeout 400 python3 -m pagedkv bench parallel tp1 tp2-bound --out "$R" > "$R/tp.log" 2>&1
grep -E "^tp|Error" "$R/tp.log" | cut -c1-900 | tee -a "$R/summary.log"
finish_log
