#!/usr/bin/env bash
# Second two-GPU call: data parallel (DP=2) beside a diagnosis of tensor parallel on CUDA.
set -u
source benchmarks/gpu_env.sh
( timeout 110 python3 -m pagedkv bench parallel dp2 --out "$OUT" > "$OUT/dp2.log" 2>&1 ) &
timeout 50 python3 benchmarks/diag_tp.py eager > "$OUT/tp_eager.log" 2>&1
timeout 50 python3 benchmarks/diag_tp.py graphs > "$OUT/tp_graphs.log" 2>&1
wait
tail -5 "$OUT/dp2.log"; grep -v "^ *$" "$OUT/tp_eager.log" | head -40; grep -v "^ *$" "$OUT/tp_graphs.log" | head -30
