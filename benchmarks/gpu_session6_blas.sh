#!/usr/bin/env bash
# Session 6, one GPU (~1 minute): host and device time per projection call, cuBLASLt against cuBLAS.
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r6blas
say "blas"; timeout 120 python3 benchmarks/blas_host_cost.py "$R/blas_host_cost.json" > "$R/blas.log" 2>&1
cat "$R/blas.log" | cut -c1-200 >> "$R/summary.log"
finish_log
