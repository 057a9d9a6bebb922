#!/usr/bin/env bash
# Session 6, one GPU (~2 minutes): the eager A/B again, with a profile of mixed steps in each mode.
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r6ab2
say "eager A/B + profile"; AB_PROFILE_DIR="$R" timeout 200 python3 benchmarks/eager_launch_ab.py "$R/eager_launch_ab.json" > "$R/ab.log" 2>&1
grep -E "^\{|Error" "$R/ab.log" | cut -c1-600 | tee -a "$R/summary.log"
for m in triton bound; do head -30 "$R/eager_mixed_$m.txt" | cut -c1-200 >> "$R/summary.log"; done
finish_log
