#!/usr/bin/env bash
# Session 6, one GPU (~3 minutes): the eager A/B a third time, and the nano-vllm engine workload with graphs
# and eager (bound launches) at this commit.
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r6eng
say "eager A/B, run 3"; timeout 150 python3 benchmarks/eager_launch_ab.py "$R/eager_launch_ab_run3.json" > "$R/ab.log" 2>&1
grep -E "^\{|Error" "$R/ab.log" | cut -c1-500 | tee -a "$R/summary.log"
say "engine nano-vllm (graphs, eager)"; mkdir -p "$R/eng"
timeout 200 python3 -m pagedkv bench engine --skip-hf --skip pagedkv_hf_modules --out "$R/eng" > "$R/eng.log" 2>&1
grep -E "^\||Greedy|Error" "$R/eng.log" | cut -c1-160 >> "$R/summary.log"
finish_log
