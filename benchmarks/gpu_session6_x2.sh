#!/usr/bin/env bash
# Session 6, two GPUs (nvidia-h200-x2), call A (~8 minutes): the all-reduce per call in graphs (NCCL against
# symmetric memory), the TP GPU tests (both all-reduces, rank-0 sampling), then Llama-3-8B TP=2 with NCCL and
# with the symmetric-memory all-reduce (decode phases and the nano workload). Call B: gpu_session6_x2_routing.sh.
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r6x2
nvidia-smi topo -m > "$R/topo.txt" 2>&1
say "all-reduce per call"; timeout 150 python3 benchmarks/all_reduce_bench.py "$R/all_reduce.jsonl" > "$R/all_reduce.log" 2>&1
cut -c1-300 "$R/all_reduce.jsonl" >> "$R/summary.log"; grep -E "Error|error" "$R/all_reduce.log" | head -5 >> "$R/summary.log"
say "TP and DP GPU tests"; timeout 170 $PYTEST -m gpu tests/test_tensor_parallel_gpu.py tests/test_data_parallel_gpu.py > "$R/tp_tests.log" 2>&1
tail -4 "$R/tp_tests.log" >> "$R/summary.log"
say "tp2, tp2-symm"; timeout 260 python3 -m pagedkv bench parallel tp2 tp2-symm --out "$R" > "$R/tp.log" 2>&1
grep -E "^tp2|Error" "$R/tp.log" | cut -c1-900 | tee -a "$R/summary.log"
finish_log
